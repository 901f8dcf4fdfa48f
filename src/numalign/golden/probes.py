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

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from numalign.golden.manifest import PROBE_REQUEST, Call
from numalign.golden.reference import flatten

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


def norm_probe(module: Any, dtype: torch.dtype, tensors: int) -> torch.Tensor | None:
    """A norm's probe: ``NORM_ROWS`` rows whose variance is its epsilon (at least
    ``MIN_VARIANCE``), in ``dtype``; None for a module that is no norm with a float epsilon
    or whose recorded call took other than one tensor (``tensors``: a gated norm takes two)."""
    import torch

    eps, width = norm_epsilon(module), _width(module)
    if eps is None or width is None or tensors != 1:
        return None
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(1, NORM_ROWS, width, generator=generator, dtype=torch.float64)
    variance = rows.var(dim=-1, unbiased=False, keepdim=True)
    return (rows * (max(eps, MIN_VARIANCE) / variance).sqrt()).to(dtype)


def activation_probe(dtype: torch.dtype) -> torch.Tensor:
    """An activation's probe: ``ACTIVATION_GRID`` values of its gating tail, in ``dtype``."""
    import torch

    low, high = ACTIVATION_TAIL
    side = int(ACTIVATION_GRID**0.5)
    return torch.linspace(low, high, ACTIVATION_GRID, dtype=dtype).reshape(1, side, side)


def _width(module: Any) -> int | None:
    """The last dimension a norm normalises: its weight's, or its normalized_shape's."""
    weight = getattr(module, "weight", None)
    if weight is not None and getattr(weight, "dim", lambda: 0)() == 1:
        return int(weight.shape[0])
    shape = getattr(module, "normalized_shape", None)
    if shape:
        return int(shape[-1])
    return None


def record_probes(
    model: Any,
    calls: Mapping[str, Mapping[str, Sequence[Call]]],
    activations: bool,
    on_call: Callable[[str, str, tuple[Any, ...], dict[str, Any], Any], None],
) -> list[str]:
    """Each probe through ``on_call(request, point, args, kwargs, output)``, the capture's
    recorder, under ``PROBE_REQUEST``: of every recorded point (``calls``: point -> request
    -> its calls) that is a norm, and with ``activations`` of each ``activation_points``
    module; the names of the points probed. A module that cannot run its probe, or gives a
    non-finite output, has none (the probe is an addition: never a reason a capture fails)."""
    import torch

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    probes: dict[str, torch.Tensor | None] = {}
    for name, requests in calls.items():
        first = next((c for recorded in requests.values() for c in recorded), None)
        if first is not None:
            tensors = sum(k is not None for k in first.args) + len(first.kwargs)
            probes[name] = norm_probe(model.get_submodule(name), dtype, tensors)
    for name in activation_points(model) if activations else ():
        probes.setdefault(name, activation_probe(dtype))
    probed = []
    for name, x in probes.items():
        if x is None:
            continue
        # fed on the CPU, as the requests' inputs are (an offloaded model's hooks move it)
        try:
            with torch.no_grad():
                output = model.get_submodule(name)(x)
            first_out = next((t for _, t in flatten(output) if isinstance(t, torch.Tensor)), None)
            finite = first_out is not None and bool(torch.isfinite(first_out).all())
        except Exception:  # a module that takes more than its hidden states: no probe
            continue
        if finite:
            on_call(PROBE_REQUEST, name, (x,), {}, output)
            probed.append(name)
    return probed
