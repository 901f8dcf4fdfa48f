"""The requests a capture runs: the built-in or given prompts, tokenized and padded both ways,
and for image-text models an image request through the PIL image processor."""

from __future__ import annotations

from collections.abc import Sequence
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


@dataclass
class CaptureRequest:
    name: str
    inputs: dict[str, Any]
    generate: bool = False


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
            from numalign.cases import generator

            vocab = int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)
            gen = generator("numalign.capture", "text")
            rows = [torch.randint(1, vocab, (n,), generator=gen) for n in SEEDED_LENGTHS]
            width = max(SEEDED_LENGTHS)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for i, row in enumerate(rows):
                sl = slice(width - len(row), width) if side == "left" else slice(0, len(row))
                ids[i, sl], mask[i, sl] = row, 1
            inputs = {"input_ids": ids, "attention_mask": mask}
        requests.append(CaptureRequest(f"text-{side}pad", inputs, generate=(side == "left")))
    return requests


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
    side = 56
    processor = Qwen2VLImageProcessorPil(min_pixels=side * side, max_pixels=side * side)
    pixels = processor(images=[image.resize((side, side))], return_tensors="pt")
    merge = int(getattr(config.vision_config, "spatial_merge_size", 2))
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
