"""What a capture point is fed, when the fault is in it: a point that fails in the whole model
but passes alone on the golden inputs, with every point upstream within budget, may be fed
a wrong input no capture point covers (a mask the model builds, position embeddings, a keyword
argument). ``input_at_fault`` reruns the model's request, takes what the model fed the point's
call, and replays the point on the golden inputs with one of them replaced by the model's own
at a time: the inputs whose replacement alone makes the point fail are at fault. When none
does, the error came in with the hidden states (``None``: accumulated).

The masks a model builds through transformers' mask functions are capture points of their
own (``golden.mask_points``); a mask built any other way is named here, as an input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from numalign.compare.exact import attends
from numalign.core.statistics import TensorStatistics
from numalign.golden.positions import kept_positions
from numalign.golden.reference import forward_kwargs
from numalign.golden.routing import point_tensors
from numalign.replay.layer import (
    CallOrder,
    call_inputs,
    request_mask,
)

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import Call, GoldenSet


@dataclass(frozen=True)
class FaultyInput:
    """An input the model fed a point that makes it fail alone: its name (a keyword, or
    ``args[i]``), how much of it differs from the golden one, and the replay's result."""

    name: str
    differs: str
    result: Any


def fed_inputs(
    model: Any, golden: GoldenSet, request: str, point: str, call: int, device: Any, dtype: Any
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The positional and keyword inputs the model fed the call of ``point`` in ``request``
    that is its ``call``-th recorded one (``CallOrder``; None when the model made no such
    call)."""
    import torch

    module = model.get_submodule(point)
    order = CallOrder(golden.point(point).calls.get(request, []))
    seen: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def pre(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        index = order.index(args, kwargs)
        if index is not None:
            seen.setdefault(index, (detached(args), detached(kwargs)))

    inputs = {
        k: golden.tensor(v, device=device, dtype=dtype)
        for k, v in golden.request(request).inputs.items()
    }
    handle = module.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs, **forward_kwargs(model))
    finally:
        handle.remove()
    return seen.get(call)


def input_at_fault(
    golden: GoldenSet,
    model: Any,
    point: str,
    request: str,
    call: int,
    judge: Any,
    device: Any,
    dtype: torch.dtype,
) -> list[FaultyInput] | None:
    """The inputs of the point's call that make it fail alone (``judge(path, actual,
    expected)`` -> CompareResult judges each output against the isolated budget); None when
    the model's inputs could not be taken (a compiled model, a call not recorded)."""
    import torch

    calls = golden.point(point).calls.get(request, [])
    if call >= len(calls) or not hasattr(model, "get_submodule"):
        return None
    recorded = calls[call]
    fed = fed_inputs(model, golden, request, point, call, device, dtype)
    if fed is None:
        return None
    fed_args, fed_kwargs = fed
    module = model.get_submodule(point)
    mask = request_mask(golden, request)
    faulty = []
    fed_dtype = _fed_dtype((fed_args, fed_kwargs), dtype)
    for name, replace in _replaceable(recorded, fed_args, fed_kwargs):
        args, kwargs = call_inputs(golden, recorded, device=device, dtype=fed_dtype)
        golden_value = args[replace] if isinstance(replace, int) else kwargs.get(replace)
        own = fed_args[replace] if isinstance(replace, int) else fed_kwargs[replace]
        if isinstance(replace, int):
            args[replace] = own
        else:
            kwargs[replace] = own
        with torch.no_grad():
            outputs = dict(point_tensors(module(*args, **kwargs)))
        failed = None
        for path, key in recorded.outputs.items():
            if path not in outputs:
                continue
            truth = golden.expected(key)
            expected = truth if isinstance(truth, TensorStatistics) else kept_positions(truth, mask)
            result = judge(path, kept_positions(outputs[path].detach(), mask), expected)
            if not result.passed:
                failed = result
                break
        if failed is not None:
            faulty.append(FaultyInput(name, _difference(own, golden_value), failed))
    return faulty


def _replaceable(
    recorded: Call, fed_args: tuple[Any, ...], fed_kwargs: dict[str, Any]
) -> list[tuple[str, int | str]]:
    """The recorded tensor inputs the model also fed: keywords first (what no capture point
    covers), then positional ones (the hidden states an upstream point produced)."""
    out: list[tuple[str, int | str]] = [
        (name, name) for name in recorded.kwargs if _tensors(fed_kwargs.get(name))
    ]
    out += [
        (f"args[{i}]", i)
        for i, key in enumerate(recorded.args)
        if key is not None and i < len(fed_args) and _tensors(fed_args[i])
    ]
    return out


def _difference(own: Any, golden_value: Any) -> str:
    """How the model's input differs from the golden one: for a mask, how many entries
    attend differently; for values, the largest difference."""
    mine, theirs = _leaves(own), _leaves(golden_value)
    if len(mine) != len(theirs):
        return f"{len(mine)} tensors where the golden input has {len(theirs)}"
    parts = []
    for a, e in zip(mine, theirs, strict=True):
        if a.shape != e.shape:
            parts.append(f"shape {tuple(a.shape)} where the golden one is {tuple(e.shape)}")
        elif _is_mask(a) or _is_mask(e):
            differ = int((attends(a) != attends(e.to(a.device))).sum())
            parts.append(f"{differ} of {a.numel()} mask entries attend differently")
        else:
            diff = (a.double() - e.to(a.device).double()).abs().max()
            parts.append(f"largest difference {float(diff):.3g}")
    return "; ".join(parts)


def _is_mask(t: torch.Tensor) -> bool:
    import torch

    return t.dtype == torch.bool or (t.is_floating_point() and bool((t < -1e30).any()))


def _leaves(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _leaves(v)]
    if isinstance(value, dict):  # a keyword input by kind (Zaya's masks)
        return [t for v in value.values() for t in _leaves(v)]
    return []


def _tensors(value: Any) -> bool:
    return bool(_leaves(value))


def detached(value: Any) -> Any:
    """A copy of a call's inputs, tensors detached and cloned (tuples, lists and dicts kept),
    so the replay that goes on cannot change what was taken."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(detached(v) for v in value)
    if isinstance(value, list):
        return [detached(v) for v in value]
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    return value


def _fed_dtype(fed: Any, dtype: torch.dtype) -> torch.dtype:
    """The dtype the model fed a point's floating inputs in (its first floating one's), which
    the golden inputs beside the model's own are fed in; ``dtype`` where none is floating."""
    import torch

    from numalign.golden.reference import flatten

    return next((t.dtype for _, t in flatten(fed)
                 if isinstance(t, torch.Tensor) and t.is_floating_point()), dtype)  # fmt: skip
