"""How a capture and its calibration members load the reference: whole
(``reference.load_model``), placed by accelerate (``reference.Placement``) or streamed unit by
unit from the safetensors (``golden.stream``), and the automatic choice between whole and
streamed (``numalign capture`` without ``--stream``/``--no-stream``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.golden.long_bound import available_memory
from numalign.golden.reference import Placement, load_model
from numalign.golden.stream import checkpoint_files, load_streamed

if TYPE_CHECKING:
    import torch

#: The automatic choice streams a capture's reference whose weights (in the reference
#: dtype) exceed this share of the memory available: besides the weights, an unstreamed
#: capture holds the requests' activations (the long requests' attention scores and KV
#: cache, ``long_bound``), the golden shard being written (up to 256 MB) and torch's and
#: transformers' own (about 1 GB), and transformers' loading converts a layer's tensors
#: (fusing MoE experts) with both forms held at once. A quarter of the memory left for those
#: keeps a reference that loads from swapping; streaming one that would fit costs a read of
#: the checkpoint per forward, so the share is not lower.
STREAM_SHARE = 0.75

_STREAM_OR_PLACE = (
    "--stream and --device-map are two ways of running a model whose weights do not fit in "
    "memory: give one (--stream reads one layer at a time from the checkpoint's "
    "safetensors; --device-map places and offloads the model with accelerate)"
)


def load_reference(
    model_dir: str | Path,
    dtype: str,
    *,
    attn_implementation: str | None,
    trust_remote_code: bool,
    experts_implementation: str | None = None,
    placement: Placement | None = None,
    stream: bool = False,
    device: torch.device | str = "cpu",
) -> Any:
    """The reference model of ``model_dir`` in ``dtype`` on ``device``: whole
    (``reference.load_model``, moved to ``device`` unless ``placement`` places it), or with
    ``stream`` streamed unit by unit (:func:`load_streamed`, its weights on meta but while
    a unit runs). The one place a capture and its calibration members load the model, so
    that streaming is one switch. ValueError for ``stream`` with ``placement`` (two ways of
    holding weights that do not fit: one at a time)."""
    if stream:
        if placement is not None:
            raise ValueError(_STREAM_OR_PLACE)
        return load_streamed(
            model_dir, dtype, device, attn_implementation=attn_implementation,
            experts_implementation=experts_implementation, trust_remote_code=trust_remote_code,
        )  # fmt: skip
    model = load_model(
        Path(model_dir), dtype, attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code, experts_implementation=experts_implementation,
        placement=placement,
    )  # fmt: skip
    return model if placement is not None else model.to(device)


def checkpoint_bytes(model_dir: str | Path, dtype_bytes: int) -> int | None:
    """The bytes of the checkpoint's tensors held in a dtype of ``dtype_bytes`` bytes per
    element (4: float32), counted from the safetensors headers alone (no tensor is read);
    None where the folder has no safetensors checkpoint (it cannot stream) or a header
    cannot be read."""
    import math

    from safetensors import safe_open

    try:
        files = sorted(set(checkpoint_files(Path(model_dir)).values()))
        elements = 0
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                elements += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (a safetensors handle, not a dict)
    except (OSError, ValueError, RuntimeError):  # no safetensors, an absent shard, no header
        return None
    return elements * dtype_bytes


def stream_choice(
    model_dir: str | Path,
    dtype: str,
    asked: bool | None,
    *,
    placement: Placement | None = None,
) -> tuple[bool, str | None]:
    """Whether a capture of ``model_dir`` in ``dtype`` streams its reference, and the line
    that says why where it was not asked (``asked`` None: the automatic choice). Asked
    (``--stream``/``--no-stream``): as asked. Automatic: streams where the checkpoint's
    weights in ``dtype`` (``checkpoint_bytes``) exceed ``STREAM_SHARE`` of the memory
    available (``long_bound.available_memory``); never under big-model ``placement`` (the
    user chose it) nor where the weights or the memory are not known."""
    if asked and placement is not None:
        raise ValueError(_STREAM_OR_PLACE)
    if asked is not None:
        return asked, None
    if placement is not None:
        return False, None
    weights = checkpoint_bytes(model_dir, 8 if dtype == "float64" else 4)
    available = available_memory()
    if weights is None or available is None or weights <= STREAM_SHARE * available:
        return False, None
    return True, (
        f"numalign capture: the {dtype} reference needs {weights / 1e9:.1f} GB and "
        f"{available / 1e9:.1f} GB is available: streaming its weights unit by unit "
        f"(--stream; more than {STREAM_SHARE:.0%} of the memory available streams, "
        "--no-stream loads it whole)"
    )
