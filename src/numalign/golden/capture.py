"""Capturing a golden set from a local Hugging Face model folder.

Forward pre-hooks (with kwargs) and forward hooks on the capture points record each point's
inputs and outputs while the reference forward runs; tensors go to safetensors shards of
bounded size as they arrive, so peak memory stays near the model plus one shard. A tensor two
points share (one layer's output is the next one's input) is stored once: by storage identity,
then by content hash. The set is written into a temporary folder and renamed into place.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.golden.fingerprint import fingerprint
from numalign.golden.store import FORMAT, MANIFEST, GoldenSet, sha256_file

if TYPE_CHECKING:
    import torch

#: Shards are cut at this size by default: small enough to keep capture memory bounded.
DEFAULT_SHARD_BYTES = 64 << 20
#: Prompts of the built-in text requests (tokenized when the model has a tokenizer).
DEFAULT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog while the accelerator checks its numerics.",
    "Alignment means every layer agrees.",
)
#: Seeded token ids when the model has no tokenizer: lengths of the two padded rows.
SEEDED_LENGTHS = (16, 9)
DEFAULT_CONTINUATION = 8
#: Module class names that are capture points inside a block.
_BLOCK_PARTS = re.compile(
    r"(Attention|Attn|MLP|Mlp|MoE|Moe|MoeBlock|Experts|GatedDeltaNet|Norm|LayerNorm"
    r"|Intermediate|Output)$"  # an encoder layer's feed-forward halves (BERT)
)
#: The model outputs captured when there are no logits (encoders), in this order.
ENCODER_OUTPUTS = ("last_hidden_state", "pooler_output")
_SKIP_TYPES = re.compile(r"(RotaryEmbedding|Dropout|Activation|ModuleList|ModuleDict|Identity)$")


# -- tensor sink: dedup and shards ------------------------------------------------------------
@dataclass
class _Sink:
    folder: Path
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)
    _buffer: dict[str, torch.Tensor] = field(default_factory=dict)
    _buffer_bytes: int = 0
    _by_identity: dict[tuple[Any, ...], tuple[str, weakref.ref[torch.Tensor]]] = field(
        default_factory=dict
    )
    _by_content: dict[str, str] = field(default_factory=dict)

    def put(self, key: str, tensor: torch.Tensor) -> str:
        """Stores ``tensor`` under ``key`` unless the same storage or content is already
        stored; returns the key that holds it."""
        t = tensor.detach()
        identity = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            str(t.dtype),
            str(t.device),
        )
        known = self._by_identity.get(identity)
        # Same storage, still alive (a dead tensor's address may be reused by another).
        if known is not None and known[1]() is not None:
            return known[0]
        cpu = t.to("cpu", copy=True).contiguous()
        digest = hashlib.sha256(
            str(cpu.dtype).encode() + str(tuple(cpu.shape)).encode() + _raw_bytes(cpu)
        ).hexdigest()
        if digest in self._by_content:
            existing = self._by_content[digest]
            self._by_identity[identity] = (existing, weakref.ref(tensor))
            return existing
        self._by_identity[identity] = (key, weakref.ref(tensor))
        self._by_content[digest] = key
        nbytes = cpu.numel() * cpu.element_size()
        self._buffer[key] = cpu
        self._buffer_bytes += nbytes
        self.tensors[key] = {
            "shard": self._shard_name(len(self.shards) + 1),
            "dtype": str(cpu.dtype).removeprefix("torch."),
            "shape": list(cpu.shape),
            "bytes": nbytes,
        }
        if self._buffer_bytes >= self.max_shard_bytes:
            self.flush()
        return key

    def release(self) -> None:
        """Forgets storage identities (between forwards)."""
        self._by_identity.clear()

    @staticmethod
    def _shard_name(index: int) -> str:
        return f"tensors-{index:05d}.safetensors"

    def flush(self) -> None:
        if not self._buffer:
            return
        from safetensors.torch import save_file

        name = self._shard_name(len(self.shards) + 1)
        path = self.folder / name
        save_file(self._buffer, str(path))
        self.shards[name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        self._buffer = {}
        self._buffer_bytes = 0


def _raw_bytes(t: torch.Tensor) -> bytes:
    import torch

    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


# -- what to capture --------------------------------------------------------------------------
def default_points(model: torch.nn.Module) -> list[str]:
    """Embeddings, every block (decoder or vision) with its attention, MLP or MoE and norms,
    the final norm, the LM head, and the vision patch embedding and merger."""
    import torch

    blocks = {
        name
        for name, module in model.named_modules()
        if name.rpartition(".")[2].isdigit()
        and isinstance(model.get_submodule(name.rpartition(".")[0]), torch.nn.ModuleList)
        and not _SKIP_TYPES.search(type(module).__name__)
    }

    def in_block(name: str) -> bool:
        return any(name.startswith(b + ".") for b in blocks)

    def wanted(name: str, module: torch.nn.Module) -> bool:
        kind = type(module).__name__
        if not name or _SKIP_TYPES.search(kind):
            return False
        if name in blocks or name == "lm_head" or name.endswith((".merger", ".patch_embed")):
            return True
        if name.rpartition(".")[0] in blocks:  # a block's attention, MLP, MoE or norm
            return bool(_BLOCK_PARTS.search(kind))
        if isinstance(module, torch.nn.Embedding):
            return not in_block(name)
        # the final norm: outside every block and outside the vision tower
        return (
            kind.endswith("Norm")
            and not in_block(name)
            and ".visual" not in name
            and "merger" not in name
        )

    return [name for name, module in model.named_modules() if wanted(name, module)]


def select_points(model: torch.nn.Module, patterns: Sequence[str] | None) -> list[str]:
    """The default points, or the modules whose names match any of ``patterns`` (fnmatch)."""
    if not patterns:
        return default_points(model)
    names = [
        n
        for n, _ in model.named_modules()
        if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)
    ]
    if not names:
        raise ValueError(
            f"--points {list(patterns)} match no module; module names look like "
            f"{[n for n, _ in model.named_modules() if n][:6]}"
        )
    return names


# -- flattening inputs and outputs ------------------------------------------------------------
def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs of nested tuples, lists, dicts and ModelOutputs; tensors are leaves."""
    import torch

    if isinstance(value, torch.Tensor) or value is None:
        yield prefix or "0", value
    elif isinstance(value, dict) or (hasattr(value, "to_tuple") and hasattr(value, "keys")):
        for k in value:  # dicts and ModelOutputs iterate their keys
            yield from flatten(value[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from flatten(item, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix or "0", value


def jsonable(value: Any) -> Any:
    """A JSON value for simple kwargs; a marked repr for anything else."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)) and all(
        v is None or isinstance(v, (bool, int, float, str)) for v in value
    ):
        return list(value)
    return {"__repr__": type(value).__name__}


# -- requests ---------------------------------------------------------------------------------
@dataclass
class Request:
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
) -> list[Request]:
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
        requests.append(Request(f"text-{side}pad", inputs, generate=(side == "left")))
    return requests


def test_image() -> Any:
    """A deterministic 56x56 test image: gradients and a checkerboard (no file, no network)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:56, 0:56]
    rgb = np.stack([x * 4, y * 4, ((x // 7 + y // 7) % 2) * 200 + 20], axis=-1)
    return Image.fromarray(rgb.astype("uint8"), "RGB")


def image_request(model_dir: Path, config: Any, image_path: str | None) -> Request | None:
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
    return Request(
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


# -- hooks --------------------------------------------------------------------------------------
@contextmanager
def hooks(
    model: torch.nn.Module,
    points: Sequence[str],
    on_call: Callable[[str, tuple[Any, ...], dict[str, Any], Any], None],
) -> Iterator[None]:
    """Calls ``on_call(point, args, kwargs, output)`` after each call of each point."""
    handles = []
    pending: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
    for name in points:
        module = model.get_submodule(name)

        def pre(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str = name) -> None:
            pending.setdefault(name, []).append((args, dict(kwargs)))

        def post(
            mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, name: str = name
        ) -> None:
            saved_args, saved_kwargs = pending[name].pop()
            on_call(name, saved_args, saved_kwargs, output)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# -- capture ------------------------------------------------------------------------------------
def load_model(
    model_dir: Path,
    dtype: str,
    *,
    attn_implementation: str | None,
    trust_remote_code: bool,
    experts_implementation: str | None = None,
) -> Any:
    """A model from a local folder, offline, in ``dtype``, for inference."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = transformers.AutoConfig.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=trust_remote_code
    )
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        cls = transformers.AutoModelForCausalLM
    kwargs: dict[str, Any] = {
        "local_files_only": True,
        "dtype": getattr(torch, dtype),
        "trust_remote_code": trust_remote_code,
    }
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if experts_implementation:
        kwargs["experts_implementation"] = experts_implementation
    model = cls.from_pretrained(model_dir, **kwargs)
    model.eval()
    return model


def forward_kwargs(model: Any) -> dict[str, Any]:
    """Keyword arguments of a reference forward: no KV cache, where the model has one."""
    import inspect

    takes = "use_cache" in inspect.signature(model.forward).parameters
    return {"use_cache": False} if takes else {}


def model_outputs(result: Any) -> dict[str, torch.Tensor]:
    """The model's own outputs that a golden set keeps: the logits of a language model, or an
    encoder's last hidden state and pooled output. Anything else is an error naming the
    output type."""
    logits = getattr(result, "logits", None)
    if logits is not None:
        return {"logits": logits}
    found: dict[str, torch.Tensor] = {
        k: getattr(result, k) for k in ENCODER_OUTPUTS if getattr(result, k, None) is not None
    }
    if not found:
        raise TypeError(
            f"the model returned {type(result).__name__}, which has neither logits nor "
            f"{' nor '.join(ENCODER_OUTPUTS)}: numalign captures causal and masked language "
            "models, image-text models and encoders; capture another head of this model (its "
            "...ForCausalLM or ...Model class) or open an issue with the output type"
        )
    return found


class _Progress:
    """A progress bar on a terminal (tqdm, which transformers brings): one step per request
    forward and per calibrated dtype; silent elsewhere."""

    def __init__(self, enabled: bool, total: int, name: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=f"capture {name}", unit="step", disable=not enabled)

    def step(self, text: str) -> None:
        self.bar.set_postfix_str(text)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def capture(
    model_dir: str | Path,
    out: str | Path,
    *,
    points: Sequence[str] | None = None,
    prompts: Sequence[str] | None = None,
    image: str | None = None,
    reference_dtype: str = "float32",
    calibrate: Sequence[str] = ("bfloat16", "float16"),
    continuation: int = DEFAULT_CONTINUATION,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool | None = None,
) -> GoldenSet:
    """Captures a golden set of the model in ``model_dir`` into ``out`` (replaced atomically:
    an interrupted capture leaves any previous set untouched and no partial folder)."""
    import torch
    import transformers

    from numalign.golden.calibrate import calibrate as run_calibration

    model_dir, out = Path(model_dir).resolve(), Path(out)
    if reference_dtype not in ("float32", "float64"):
        raise ValueError(f"--reference-dtype {reference_dtype!r}: float32 or float64")
    show = sys.stderr.isatty() if progress is None else progress
    # eager attention by default: the reference implementation, whose explicit 4D masks every
    # other attention implementation accepts when a point is replayed alone
    attn_implementation = attn_implementation or "eager"
    torch.manual_seed(0)
    model = load_model(
        model_dir,
        reference_dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    config = model.config
    requests = text_requests(model_dir, config, prompts or DEFAULT_PROMPTS, trust_remote_code)
    extra = image_request(model_dir, config, image)
    if extra is not None:
        requests.append(extra)
    point_names = select_points(model, points)
    order = {name: i for i, name in enumerate(n for n, _ in model.named_modules())}

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out.parent)
    tmp = out.parent / f".{out.name}.capture-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    bar = _Progress(show, len(requests) + len(calibrate), out.name)
    try:
        sink = _Sink(tmp, max_shard_bytes)
        calls: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in point_names}
        types = {n: type(model.get_submodule(n)).__name__ for n in point_names}
        manifest_requests, logits, continuations = [], {}, {}
        outputs: dict[str, dict[str, str]] = {}
        for request in requests:
            bar.step(f"request {request.name}")
            inputs = {
                k: sink.put(f"{request.name}/inputs/{k}", v) for k, v in request.inputs.items()
            }

            def on_call(
                name: str,
                args: tuple[Any, ...],
                kwargs: dict[str, Any],
                output: Any,
                request: Request = request,
            ) -> None:
                number = len(calls[name].setdefault(request.name, []))
                base = f"{request.name}/{name}/{number}"
                arg_keys: list[str | None] = []
                arg_json: list[Any] = []
                for i, a in enumerate(args):
                    if isinstance(a, torch.Tensor):
                        arg_keys.append(sink.put(f"{base}/args/{i}", a))
                        arg_json.append(None)
                    else:
                        arg_keys.append(None)
                        arg_json.append(jsonable(a))
                kw_keys: dict[str, Any] = {}
                kw_json: dict[str, Any] = {}
                for k, v in kwargs.items():
                    leaves = list(flatten(v))
                    if leaves and all(isinstance(t, torch.Tensor) for _, t in leaves):
                        keys = [sink.put(f"{base}/kwargs/{k}/{p}", t) for p, t in leaves]
                        kw_keys[k] = keys[0] if isinstance(v, torch.Tensor) else keys
                    else:
                        kw_json[k] = jsonable(v)
                outputs = {
                    p: sink.put(f"{base}/out/{p}", t)
                    for p, t in flatten(output)
                    if isinstance(t, torch.Tensor)
                }
                calls[name][request.name].append(
                    {
                        "args": arg_keys,
                        "args_json": arg_json,
                        "kwargs": kw_keys,
                        "kwargs_json": kw_json,
                        "outputs": outputs,
                    }
                )

            with torch.no_grad(), hooks(model, point_names, on_call):
                result = model(**request.inputs, **forward_kwargs(model))
            finals = model_outputs(result)
            if "logits" in finals:
                logits[request.name] = sink.put(f"{request.name}/logits", finals["logits"])
            else:
                outputs[request.name] = {
                    k: sink.put(f"{request.name}/output/{k}", t) for k, t in finals.items()
                }
            sink.release()
            if request.generate and continuation > 0 and "logits" in finals:
                continuations[request.name] = _greedy(model, request, continuation, sink)
            manifest_requests.append({"name": request.name, "inputs": inputs})
        sink.flush()
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": {
                "path": os.path.relpath(model_dir, out.resolve()),
                "name": model_dir.name,
                "architecture": type(model).__name__,
                "model_type": getattr(config, "model_type", None),
                "fingerprint": fingerprint(model_dir),
            },
            "reference": {
                "device": "cpu",
                "dtype": reference_dtype,
                "attn_implementation": getattr(config, "_attn_implementation", None),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "seed": 0,
            },
            "requests": manifest_requests,
            "points": [
                {"name": n, "type": types[n], "order": order[n], "calls": calls[n]}
                for n in sorted(point_names, key=lambda n: order[n])
                if calls[n]
            ],
            "logits": logits,
            **({"outputs": outputs} if outputs else {}),
            "continuation": continuations,
            "tensors": sink.tensors,
            "shards": sink.shards,
            "calibration": {},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        golden = GoldenSet.open(tmp)
        for dtype in calibrate:
            bar.step(f"calibrating {dtype}")
            manifest["calibration"][dtype] = run_calibration(
                golden,
                model_dir,
                dtype,
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
            )
        (tmp / MANIFEST).write_text(
            json.dumps(manifest, indent=1, allow_nan=False), encoding="utf-8"
        )
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return GoldenSet.open(out)


def _greedy(model: Any, request: Request, steps: int, sink: _Sink) -> dict[str, str]:
    """``steps`` greedy tokens, re-running the whole sequence each step (no cache), and the
    logits of each step."""
    import torch

    inputs = dict(request.inputs)
    tokens, step_logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(**inputs, **forward_kwargs(model)).logits[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(nxt)
            step_logits.append(logits)
            inputs = append_token(inputs, nxt)
    return {
        "tokens": sink.put(f"{request.name}/continuation/tokens", torch.cat(tokens, dim=1)),
        "logits": sink.put(f"{request.name}/continuation/logits", torch.stack(step_logits, dim=1)),
    }


def remove_abandoned(folder: Path) -> list[Path]:
    """Removes the temporary folders of captures whose process died (a SIGKILL cannot clean
    up after itself); a live capture's folder is left alone."""
    removed = []
    for tmp in folder.glob(".*.capture-*"):
        pid = tmp.name.rpartition("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
        except PermissionError:  # alive, another user's
            pass
    return removed


def append_token(inputs: dict[str, Any], token: torch.Tensor) -> dict[str, Any]:
    """The model inputs one greedy step later: ``token`` [batch, 1] appended to the ids, the
    mask extended, and (image-text models) the new position marked as text."""
    import torch

    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], token], dim=1)
    out["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(token)], dim=1)
    if "mm_token_type_ids" in inputs:
        out["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros_like(token)], dim=1
        )
    return out


def _replace(tmp: Path, out: Path) -> None:
    """Moves the finished set into place; a set it replaces is renamed aside first and
    removed after, so a kill at any moment leaves one whole set (or an explained .previous)."""
    previous = out.with_name(out.name + ".previous")
    if previous.exists():
        shutil.rmtree(previous)
    if out.exists():
        os.replace(out, previous)
    os.replace(tmp, out)
    if previous.exists():
        shutil.rmtree(previous)
