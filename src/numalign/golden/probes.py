"""Probes: calls of a capture point on inputs the model's requests never make, recorded
beside the requests' calls under the request name ``probe`` (``manifest.PROBE_REQUEST``) and
replayed alone like any call (layer replay and the isolated calibration); the whole-model
replays run requests only.

Two places where a port's error hides below every dtype's rounding on a request's values:

- **A norm's epsilon.** On the requests' rows (a mean square near one, or far larger) an
  epsilon of 1e-5 where the config says 1e-6 moves the output by 5e-6: below bfloat16's
  rounding by three orders of magnitude, and below float32's reach in a deep model. The norm
  probe feeds rows whose variance is the module's own epsilon (at least ``MIN_VARIANCE``),
  where the epsilon is half of what the row is divided by: that port errs by tens of
  percent. Every point whose module holds a float ``variance_epsilon``, ``eps`` or
  ``epsilon`` and whose recorded call takes one tensor is probed.
- **An activation's form.** Exact and tanh GELU differ by at most 4.7e-4, a ten-thousandth
  of the output's RMS on the requests' values and one eighth of a bfloat16 rounding at most.
  In the gating tail (inputs from -4 to -1), where the output is small against the input,
  they differ by up to 10% of the output, all one way: over ``ACTIVATION_GRID`` values the
  mean error there is 0.2% of the output's RMS, which the pooled lean (``compare.lean``)
  resolves in bfloat16 (the honest ensemble reaches 0.004%). The first activation module of
  each kind inside the blocks (the MLP's ``act_fn``) becomes a point with this one call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from numalign.golden.manifest import PROBE_REQUEST

if TYPE_CHECKING:
    import torch

#: Rows of a norm probe: enough for the per-channel leans (``LEAN_CHANNEL_ROWS``: 16).
NORM_ROWS = 64
#: The least variance a norm probe's rows get: float16 still holds such rows' values as
#: normal numbers (rms 1e-3; its smallest normal is 6.1e-5), so an epsilon below it (BERT's
#: 1e-12) is probed at 1e-6, where it no longer shows.
MIN_VARIANCE = 1e-6
#: The activation probe's inputs: the gating tail, where the output is small against the
#: input (exact and tanh GELU part there by up to 10% of the output, at -3; SiLU and GELU by
#: tens of percent).
ACTIVATION_TAIL = (-4.0, -1.0)
#: Its values, as [1, 128, 128]: 16384 values resolve the mean of exact GELU against the
#: tanh form at 2.3x the lean's limit in bfloat16 (4096 only at 1.6x; measured on the grid).
ACTIVATION_GRID = 128 * 128
_EPSILON_NAMES = ("variance_epsilon", "eps", "epsilon")


def norm_epsilon(module: Any) -> float | None:
    """The module's epsilon where it is a norm that holds one as a float attribute."""
    if "norm" not in type(module).__name__.lower():
        return None
    for name in _EPSILON_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float) and value > 0:
            return value
    return None


def activation_points(model: Any) -> list[str]:
    """The first activation module of each kind inside the model's blocks (outside a vision
    tower), in forward order: ``model.layers.0.mlp.act_fn`` and the like."""
    kinds: set[str] = set()
    found = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if not name or ".visual" in name or kind in kinds or not _is_activation(module):
            continue
        if not any(part.isdigit() for part in name.split(".")):  # outside every block
            continue
        kinds.add(kind)
        found.append(name)
    return found


def _is_activation(module: Any) -> bool:
    from transformers import activations

    classes = [c[0] if isinstance(c, tuple) else c for c in activations.ACT2CLS.values()]
    return any(isinstance(c, type) and isinstance(module, c) for c in classes)


def probe_inputs(model: Any, name: str, first_call_tensors: int | None) -> Any:
    """The probe input of point ``name`` (a tensor in the model's dtype), or None where the
    point has no probe (``first_call_tensors``: how many tensors its first recorded call
    took, None for a point with no recorded call, such as an activation)."""
    import torch

    module = model.get_submodule(name)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    generator = torch.Generator().manual_seed(0)
    if first_call_tensors is None:
        if not _is_activation(module):
            return None
        low, high = ACTIVATION_TAIL
        side = int(ACTIVATION_GRID**0.5)
        return torch.linspace(low, high, ACTIVATION_GRID, dtype=dtype).reshape(1, side, side)
    eps = norm_epsilon(module)
    width = _width(module)
    if eps is None or width is None or first_call_tensors != 1:
        return None
    rows = torch.randn(1, NORM_ROWS, width, generator=generator, dtype=torch.float64)
    variance = rows.var(dim=-1, unbiased=False, keepdim=True)
    return (rows * (max(eps, MIN_VARIANCE) / variance).sqrt()).to(dtype)


def _width(module: Any) -> int | None:
    """The last dimension a norm normalises: its weight's, or its normalized_shape's."""
    weight = getattr(module, "weight", None)
    if weight is not None and getattr(weight, "dim", lambda: 0)() == 1:
        return int(weight.shape[0])
    shape = getattr(module, "normalized_shape", None)
    if shape:
        return int(shape[-1])
    return None


def probe_calls(
    model: Any, points: dict[str, int | None]
) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """(point, input, output) of each point's probe (``points``: name -> how many tensors its
    first recorded call took, None for an activation point); a module that cannot run its
    probe, or gives a non-finite output, has none (the probe is an addition: never a reason
    a capture fails)."""
    import torch

    from numalign.golden.reference import flatten

    for name, tensors in points.items():
        x = probe_inputs(model, name, tensors)
        if x is None:
            continue
        # fed on the CPU, as the requests' inputs are (an offloaded model's hooks move it)
        try:
            with torch.no_grad():
                output = model.get_submodule(name)(x)
            first = next((t for _, t in flatten(output) if isinstance(t, torch.Tensor)), None)
            finite = first is not None and bool(torch.isfinite(first).all())
        except Exception:  # a module that takes more than its hidden states: no probe
            continue
        if finite:
            yield name, x, output


def record_probes(
    model: Any,
    points: dict[str, int | None],
    on_call: Callable[[str, str, tuple[Any, ...], dict[str, Any], Any], None],
) -> None:
    """Each probe through ``on_call(request, point, args, kwargs, output)``, the capture's
    recorder, under ``PROBE_REQUEST``."""
    for name, x, output in probe_calls(model, points):
        on_call(PROBE_REQUEST, name, (x,), {}, output)
