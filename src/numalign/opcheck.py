"""Runs one operator case: truth (reference in float64), control (reference in the target
dtype) and candidate (in the target dtype, on the device), then compares every output."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from numalign.cases import Case, generator, noncontiguous
from numalign.compare import CompareResult, Tolerance, TolerancePolicy, compare
from numalign.registry import Candidate, Operator

if TYPE_CHECKING:
    import torch


def _cast(
    inputs: Mapping[str, Any], dtype: torch.dtype, device: torch.device, strided: bool
) -> dict[str, Any]:
    """Floating tensors to ``dtype`` on ``device`` (non-contiguous when ``strided``); other
    tensors to ``device``; everything else as it is. Always fresh copies."""
    import torch

    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            moved = value.to(
                device=device, dtype=dtype if value.is_floating_point() else value.dtype, copy=True
            )
            out[key] = noncontiguous(moved) if strided and moved.is_floating_point() else moved
        else:
            out[key] = value
    return out


def _named(op: Operator, value: Any) -> dict[str, Any]:
    import torch

    values = (value,) if isinstance(value, torch.Tensor) else tuple(value)
    if len(values) != len(op.outputs):
        raise ValueError(
            f"{op.name}: expected {len(op.outputs)} output(s) "
            f"({', '.join(o.name for o in op.outputs)}), got {len(values)}"
        )
    return {o.name: v for o, v in zip(op.outputs, values, strict=True)}


def make_inputs(op: Operator, case: Case) -> dict[str, Any]:
    """The case's float64 inputs, seeded by operator and case (the same for every candidate
    and dtype)."""
    return op.make_inputs(case, generator(op.name, case.name, case.regime))


#: Truths kept per worker: tests of one case with other candidates reuse them.
_TRUTH_CACHE_SIZE = 4
_truths: OrderedDict[tuple[str, str, str], tuple[dict[str, Any], dict[str, Any]]] = OrderedDict()


def inputs_and_truth(
    op: Operator, case: Case, dtype: torch.dtype
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The case's inputs rounded to ``dtype`` (on the CPU) and the reference's float64
    outputs on exactly those values, cached per worker.

    The truth sees the rounded inputs, upcast: rounding the inputs is not the kernel's error,
    and selections (top-k, routing) must be judged on the values the kernel saw."""
    import torch

    key = (op.name, case.name, str(dtype))
    if key in _truths:
        _truths.move_to_end(key)
        return _truths[key]
    rounded = _cast(make_inputs(op, case), dtype, torch.device("cpu"), strided=False)
    upcast = _cast(rounded, torch.float64, torch.device("cpu"), strided=False)
    entry = (rounded, _named(op, op.reference(**upcast)))
    _truths[key] = entry
    while len(_truths) > _TRUTH_CACHE_SIZE:
        _truths.popitem(last=False)
    return entry


def check_operator(
    op: Operator,
    candidate: Candidate,
    case: Case,
    dtype: torch.dtype,
    device: torch.device,
    *,
    policy: TolerancePolicy | None = None,
) -> list[CompareResult]:
    """Compares ``candidate`` with the operator's reference on one case; one result per
    output. Float outputs are judged against the control's error budget; exact outputs
    against the control; tie-aware outputs against the truth, with ties judged on the scores
    in ``dtype``. Truth, control and candidate all see the same inputs rounded to ``dtype``."""
    inputs, truth = inputs_and_truth(op, case, dtype)
    strided = bool(case.get("noncontiguous", False))
    control = _named(op, op.reference(**_cast(inputs, dtype, device, strided=False)))
    actual = _named(op, candidate.fn(**_cast(inputs, dtype, device, strided=strided)))
    reduction = op.reduction_length(case) if op.reduction_length else None
    results = []
    for output in op.outputs:
        name = op.name if len(op.outputs) == 1 else f"{op.name}.{output.name}"
        a = actual[output.name]
        if output.kind == "float":
            result = compare(
                a,
                truth[output.name],
                control=control[output.name].to(a.device),
                op_class=op.op_class,
                reduction_length=reduction,
                name=name,
                policy=policy,
                budget=op.budget,
            )
        elif output.kind == "exact":
            tol = Tolerance(rtol=0.0, atol=output.atol) if output.atol else None
            result = compare(a, control[output.name], tolerance=tol, name=name)
        else:
            source = output.ties_from or ""
            scores = truth[source] if source in truth else inputs[source]
            result = compare(
                a, truth[output.name], ties=scores.to(dtype), name=name, op_class="selection"
            )
        results.append(result)
    return results
