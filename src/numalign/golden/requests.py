"""The requests a capture runs: the built-in or given prompts, tokenized and padded both ways,
long requests that cross every length boundary the model has, a far-position request (short
rows at explicit positions a quarter, half and all the way into the model's position range),
and for image-text models an image request through the PIL image processor."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Prompts of the built-in text requests (tokenized when the model has a tokenizer).
DEFAULT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog while the accelerator checks its numerics.",
    "Alignment means every layer agrees.",
)
#: Seeded token ids when the model has no tokenizer: lengths of the two padded rows.
SEEDED_LENGTHS = (16, 9)
#: The page (block) size of the paged KV cache that decode replay serves requests with: small,
#: so that a long request of a tiny model crosses several pages.
REPLAY_PAGE_SIZE = 16
#: The KV block (page) of a serving engine's paged cache: vLLM's CPU build takes blocks of 32
#: tokens at the least (a GPU's backends page in 16). The sets a serving engine replays are
#: captured with long requests past it (``--long``; the zoo's vLLM members: ``zoo.ZooModel.
#: long``), so that a block read stale, a prefix-cache hit (the padded requests' identical
#: rows share a full block) and rows preempted for want of blocks are served and judged.
SERVING_BLOCK = 32
#: transformers' chunk length of the chunked linear attention (gated delta rule) prefill.
LINEAR_ATTENTION_CHUNK = 64
#: Chunks a long request crosses on a model with linear attention: an error in the state
#: carried from chunk to chunk (its decay, say) reaches a prefill output only from the third
#: chunk on (the first chunk starts from a zero state, the second from one chunk's state).
LINEAR_ATTENTION_CHUNKS = 3
#: How far a long request goes past the last boundary it must cross.
LONG_MARGIN = 8
#: Positions kept free at the end of the model's range: a far row's decode steps and its
#: greedy continuation run past its last prompt position.
POSITION_HEADROOM = 16
#: Tokens per row of the far-position request.
FAR_LENGTH = 8
#: Where the far-position request's rows start, as fractions of the model's position range
#: (the last one is moved back to end ``POSITION_HEADROOM`` before the range's end).
FAR_FRACTIONS = (0.25, 0.5, 1.0)


def _same(value: Any) -> Any:
    return value


@dataclass
class CaptureRequest:
    name: str
    inputs: dict[str, Any]
    generate: bool = False


def length_boundaries(config: Any) -> dict[str, int]:
    """The sequence lengths where the model's computation changes regime: the sliding window,
    the linear-attention chunk, and the page size of paged replay (every decoder has one)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    found = {"page": REPLAY_PAGE_SIZE}
    window = getattr(text, "sliding_window", None)
    if isinstance(window, int) and window > 0:
        found["sliding_window"] = window
    if "linear_attention" in (getattr(text, "layer_types", None) or ()):
        found["linear_attention_chunks"] = LINEAR_ATTENTION_CHUNKS * LINEAR_ATTENTION_CHUNK
    return found


def max_positions(config: Any) -> int | None:
    """The model's position range (``max_position_embeddings``, GPT-2's ``n_positions``);
    None where the config sets none."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def long_length(config: Any) -> int:
    """The length of a long request: past the largest boundary by LONG_MARGIN tokens, and
    within the model's positions (less the headroom its decode needs)."""
    length = max(length_boundaries(config).values()) + LONG_MARGIN
    limit = max_positions(config)
    return max(1, min(length, limit - POSITION_HEADROOM)) if limit else length


def far_starts(config: Any, length: int, limit: int | None = None) -> list[int]:
    """The first positions of the far-position request's rows: ``FAR_FRACTIONS`` of the
    position range (``limit``, else the model's), each row of ``length`` tokens ending
    ``POSITION_HEADROOM`` before the range's end at the latest; empty where the model has no
    range or it is too short to hold a row beyond the start."""
    limit = limit or max_positions(config)
    if not limit:
        return []
    last = limit - POSITION_HEADROOM - length
    starts = sorted({min(int(limit * f), last) for f in FAR_FRACTIONS})
    return [s for s in starts if s > 0]


def far_request(
    model_dir: Path,
    config: Any,
    length: int,
    trust_remote_code: bool,
    limit: int | None = None,
) -> CaptureRequest | None:
    """One request of rows of ``length`` tokens at explicit positions far into the model's
    range (``far_starts``): what a long context computes at its end (rotary angles, learned
    position embeddings) without the long sequence. The built-in prompt's tokens (seeded ids
    without a tokenizer); unpadded; decoded. None where the model has no position range, and
    for image-text models (their multimodal rotary positions are derived from the image grid,
    not given)."""
    import torch

    starts = far_starts(config, length, limit)
    if not starts or length <= 0 or getattr(config, "vision_config", None) is not None:
        return None
    tok = _tokenizer(model_dir, trust_remote_code)
    if tok is not None:
        ids: list[int] = []
        while len(ids) < length:
            ids += tok(DEFAULT_PROMPTS[0], add_special_tokens=not ids)["input_ids"]
        row = torch.tensor(ids[:length])
    else:
        from numalign.ops.cases import generator

        vocab = int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)
        row = torch.randint(1, vocab, (length,), generator=generator("numalign.capture", "far"))
    ids_ = row.expand(len(starts), -1).clone()
    positions = torch.stack([torch.arange(s, s + length) for s in starts])
    inputs = {"input_ids": ids_, "attention_mask": torch.ones_like(ids_),
              "position_ids": positions}  # fmt: skip
    return CaptureRequest("far-positions", inputs, generate=True)


def _tokenizer(model_dir: Path, trust_remote_code: bool) -> Any:
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=trust_remote_code
    )


def text_requests(
    model_dir: Path, config: Any, prompts: Sequence[str], trust_remote_code: bool
) -> list[CaptureRequest]:
    """Two requests of the same prompts: left-padded (as generation batches) and
    right-padded (as training batches), so attention masks are exercised both ways."""
    import torch

    tok = _tokenizer(model_dir, trust_remote_code)
    requests = []
    for side in ("left", "right"):
        if tok is not None:
            tok.padding_side = side
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token or tok.unk_token
            enc = tok(list(prompts), return_tensors="pt", padding=True)
            inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        else:
            from numalign.ops.cases import generator

            vocab = int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)
            gen = generator("numalign.capture", "text")
            rows = [torch.randint(1, vocab, (n,), generator=gen) for n in SEEDED_LENGTHS]
            inputs = padded(rows, side, pad=0)
        requests.append(CaptureRequest(f"text-{side}pad", inputs, generate=(side == "left")))
    return requests


def long_requests(
    model_dir: Path, config: Any, length: int, trust_remote_code: bool
) -> list[CaptureRequest]:
    """Two requests of two rows of ``length`` and three quarters of it (so padding matters),
    left-padded (decoded) and right-padded: the built-in prompts repeated when the model has a
    tokenizer, seeded token ids otherwise."""
    import torch

    from numalign.ops.cases import generator

    tok = _tokenizer(model_dir, trust_remote_code)
    lengths = (length, max(1, length * 3 // 4))
    if tok is not None:
        text = " ".join(DEFAULT_PROMPTS)
        ids: list[int] = []
        while len(ids) < length:
            ids += tok(text, add_special_tokens=not ids)["input_ids"]
        rows = [torch.tensor(ids[:n]) for n in lengths]
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    else:
        vocab = int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)
        gen = generator("numalign.capture", f"long-{length}")
        rows = [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]
        pad = 0
    return [
        CaptureRequest(f"long-{side}pad", padded(rows, side, int(pad)), generate=(side == "left"))
        for side in ("left", "right")
    ]


def with_serving_positions(model: Any, request: CaptureRequest) -> CaptureRequest:
    """``request`` with explicit position ids where it has left-padded rows: each real
    token's index among its row's real tokens (``reference.generation_positions``), the
    positions generation and every serving engine (which never pads) give it. Without them
    the forward numbers a left-padded row's tokens from the padding, which a model with
    learned absolute positions (GPT-2) computes differently from any engine. Unchanged: a
    request with positions already (far positions), an image-text model's (multimodal rotary
    positions come from the image grid), a request without left padding, and a model whose
    forward takes no position ids (ALiBi models)."""
    import inspect

    from numalign.golden.reference import generation_positions

    inputs = request.inputs
    mask = inputs.get("attention_mask")
    if (
        mask is None
        or not bool(((mask[:, 0] == 0) & (mask.sum(-1) > 0)).any())  # no row padded left
        or "position_ids" in inputs
        or getattr(model.config, "vision_config", None) is not None
        or "position_ids" not in inspect.signature(model.forward).parameters
    ):
        return request
    positioned = {**inputs, "position_ids": generation_positions(mask)}
    return CaptureRequest(request.name, positioned, generate=request.generate)


def unservable(inputs: Mapping[str, Any], tensor: Callable[[Any], Any] = _same) -> str | None:
    """Why a serving engine (transformers' paged engine, vLLM) cannot be served a golden
    request as it was captured (None when it can): engines take token ids and derive each
    token's position from the request itself, so a request at explicit positions is served
    only where they are those (``with_serving_positions``'s). ``tensor`` reads an input's
    value (a golden set's request names tensor keys: ``GoldenSet.tensor``)."""
    from numalign.golden.reference import generation_positions

    if "pixel_values" in inputs:
        return "an image request: the engine is served token ids only"
    if "position_ids" in inputs:
        positions = tensor(inputs["position_ids"])
        mask = tensor(inputs["attention_mask"]) if "attention_mask" in inputs else None
        if (
            mask is None
            or positions.shape != mask.shape
            or not bool((positions == generation_positions(mask))[mask.bool()].all())
        ):
            return (
                "a request at explicit positions: a serving engine derives positions from the "
                "request's own tokens (the far positions are judged by the KV-cache decode)"
            )
    return None


def padded(rows: Sequence[Any], side: str, pad: int) -> dict[str, Any]:
    """Token id rows batched to the longest, padded on ``side`` with ``pad``: the model
    inputs ``input_ids`` and ``attention_mask``."""
    import torch

    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        sl = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, sl], mask[i, sl] = row, 1
    return {"input_ids": ids, "attention_mask": mask}


def test_image() -> Any:
    """A deterministic 56x56 test image: gradients and a checkerboard (no file, no network)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:56, 0:56]
    rgb = np.stack([x * 4, y * 4, ((x // 7 + y // 7) % 2) * 200 + 20], axis=-1)
    return Image.fromarray(rgb.astype("uint8"), "RGB")


def image_request(model_dir: Path, config: Any, image_path: str | None) -> CaptureRequest | None:
    """For image-text models (a vision config with image token ids): one image request,
    pixels through the PIL image processor (never torchvision)."""
    import torch

    vision_start = getattr(config, "vision_start_token_id", None)
    image_token = getattr(config, "image_token_id", None)
    if (
        getattr(config, "vision_config", None) is None
        or vision_start is None
        or image_token is None
    ):
        return None
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = Image.open(image_path).convert("RGB") if image_path else test_image()
    vision = config.vision_config
    patch = int(getattr(vision, "patch_size", 14))  # Qwen3-VL's patches are 16 pixels
    temporal = int(getattr(vision, "temporal_patch_size", 2))
    merge = int(getattr(vision, "spatial_merge_size", 2))
    side = 2 * patch * merge  # 4 x 4 patches, 2 x 2 tokens after the merge (56 px at 14)
    processor = Qwen2VLImageProcessorPil(
        min_pixels=side * side, max_pixels=side * side, patch_size=patch,
        temporal_patch_size=temporal, merge_size=merge,
    )  # fmt: skip
    pixels = processor(images=[image.resize((side, side))], return_tensors="pt")
    count = int(pixels["image_grid_thw"].prod()) // (merge * merge)
    text = [5, 17, 33]
    ids = torch.tensor(
        [[*text, vision_start, *[image_token] * count, config.vision_end_token_id, *text]]
    )
    return CaptureRequest(
        "image",
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "pixel_values": pixels["pixel_values"],
            "image_grid_thw": pixels["image_grid_thw"],
            "mm_token_type_ids": (ids == image_token).long(),
        },
        generate=True,
    )
