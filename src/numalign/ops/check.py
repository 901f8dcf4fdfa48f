"""Runs one operator case: truth (reference in float64), control (reference in the target
dtype) and candidate (in the target dtype, on the device), then compares every output."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from numalign.compare import (
    CompareResult,
    CompareSpec,
    Tolerance,
    TolerancePolicy,
    compare,
)
from numalign.compare.rounding import judge_rounding
from numalign.ops.cases import Case, generator, noncontiguous
from numalign.ops.phases import add_phase, phase
from numalign.ops.registry import Candidate, Operator, Output
from numalign.ops.truths import active_truth_cache
from numalign.records.drift import DriftRecord

if TYPE_CHECKING:
    import torch

    from numalign.runtime.compiled import CompileSpec


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
    disk = active_truth_cache()
    with phase("cache"):
        stored = disk.load(op, case, dtype) if disk is not None else None
    if stored is not None:
        entry = stored
    else:
        with phase("inputs"):
            rounded = _cast(make_inputs(op, case), dtype, torch.device("cpu"), strided=False)
        with phase("truth"):
            upcast = _cast(rounded, torch.float64, torch.device("cpu"), strided=False)
            entry = (rounded, _named(op, op.reference(**upcast)))
        if disk is not None:
            with phase("cache"):
                disk.store(op, case, dtype, *entry)
    _truths[key] = entry
    while len(_truths) > _TRUTH_CACHE_SIZE:
        _truths.popitem(last=False)
    return entry


#: Controls kept per worker, by operator (and its reference), case, dtype and device.
_controls: OrderedDict[tuple[str, int, str, str, str], dict[str, Any]] = OrderedDict()


def _control(
    op: Operator, case: Case, dtype: torch.dtype, device: torch.device, inputs: dict[str, Any]
) -> dict[str, Any]:
    """The reference run in ``dtype`` on ``device`` (the honest control), cached per worker
    like the truths: every candidate of a case is judged against the same one."""
    key = (op.name, id(op.reference), case.name, str(dtype), str(device))
    if key in _controls:
        _controls.move_to_end(key)
        return _controls[key]
    control = _named(op, op.reference(**_cast(inputs, dtype, device, strided=False)))
    _controls[key] = control
    while len(_controls) > _TRUTH_CACHE_SIZE:
        _controls.popitem(last=False)
    return control


def check_operator(
    op: Operator,
    candidate: Candidate,
    case: Case,
    dtype: torch.dtype,
    device: torch.device,
    *,
    policy: TolerancePolicy | None = None,
    compiled: CompileSpec | None = None,
) -> list[CompareResult]:
    """Compares ``candidate`` with the operator's reference on one case; one result per
    output. Float outputs are judged against the control's error budget; exact outputs
    against the control; tie-aware outputs against the truth, with ties judged on the scores
    in ``dtype``; quantized outputs by their rounding (``judge_rounding``). Truth, control and
    candidate all see the same inputs rounded to ``dtype``.

    With ``compiled``, the candidate runs through ``torch.compile`` (compiled once per worker
    and spec: ``candidate_function``); the reference and the control stay eager, so the
    compiled kernel is held to the same budget as the eager one. Compile time goes to phase
    ``compile``, not ``candidate``."""
    inputs, truth = inputs_and_truth(op, case, dtype)
    with phase("control"):
        control = _control(op, case, dtype, device, inputs)
    actual = _run_candidate(op, candidate, case, dtype, device, inputs, compiled)
    compare_start = time.perf_counter()
    run = _Run(inputs, truth, control, actual)
    reduction = op.reduction_length(case) if op.reduction_length else None
    results = [
        _judge_output(op, output, case, dtype, run, reduction, policy) for output in op.outputs
    ]
    add_phase("compare", time.perf_counter() - compare_start)
    return results


@dataclasses.dataclass(frozen=True)
class _Run:
    """One case's tensors by name: the inputs in the dtype, the truth, the control and the
    candidate's outputs."""

    inputs: dict[str, Any]
    truth: dict[str, Any]
    control: dict[str, Any]
    actual: dict[str, Any]


def _run_candidate(
    op: Operator,
    candidate: Candidate,
    case: Case,
    dtype: torch.dtype,
    device: torch.device,
    inputs: dict[str, Any],
    compiled: CompileSpec | None,
) -> dict[str, Any]:
    """The candidate's outputs by name; its time goes to phase ``candidate``, compiling it
    to phase ``compile``."""
    strided = bool(case.get("noncontiguous", False))
    fn = candidate_function(op, candidate, compiled)
    stats = getattr(fn, "stats", None)
    compiled_before = stats.compile_s if stats is not None else 0.0
    start = time.perf_counter()
    actual = _named(op, fn(**_cast(inputs, dtype, device, strided=strided)))
    spent = stats.compile_s - compiled_before if stats is not None else 0.0
    add_phase("compile", spent)
    add_phase("candidate", time.perf_counter() - start - spent)
    return actual


def _judge_output(
    op: Operator,
    output: Output,
    case: Case,
    dtype: torch.dtype,
    run: _Run,
    reduction: int | None,
    policy: TolerancePolicy | None,
) -> CompareResult:
    """One output's verdict, by its kind: float, exact, quantized or ties."""
    name = op.name if len(op.outputs) == 1 else f"{op.name}.{output.name}"
    a = run.actual[output.name]
    if output.kind == "float":
        return _judge_float(op, output, case, name, run, reduction, policy)
    if output.kind == "exact":
        tol = Tolerance(rtol=0.0, atol=output.atol) if output.atol else None
        return compare(a, run.control[output.name], CompareSpec(tolerance=tol, name=name))
    if output.kind == "quantized":
        return judge_rounding(
            a,
            run.actual[output.scale_from or ""],
            run.inputs[output.quantized_from or ""],
            output.rounding,
            output.layout_for(case),
            name=name,
            policy=policy,
        )
    source = output.ties_from or ""
    scores = run.truth[source] if source in run.truth else run.inputs[source]
    spec = CompareSpec(op_class="selection", ties=scores.to(dtype), name=name)
    return compare(a, run.truth[output.name], spec)


def _judge_float(
    op: Operator,
    output: Output,
    case: Case,
    name: str,
    run: _Run,
    reduction: int | None,
    policy: TolerancePolicy | None,
) -> CompareResult:
    """A float output against the control's error budget, with the positions that rounding
    alone decides (``output.undecided``) set to zero in all three."""
    a = run.actual[output.name]
    expected, reference = run.truth[output.name], run.control[output.name].to(a.device)
    undecided = output.undecided(run.inputs, case) if output.undecided else None
    if undecided is not None:
        a, expected, reference = (_zero_where(undecided, t) for t in (a, expected, reference))
    spec = CompareSpec(
        op_class=op.op_class,
        control=reference,
        reduction_length=reduction,
        budget=op.budget,
        name=name,
        policy=policy,
        exponent_reach=op.exponent_reach(run.inputs) if op.exponent_reach else None,
    )
    result = compare(a, expected, spec)
    if undecided is not None and bool(undecided.any()):
        count = int(undecided.sum())
        result = dataclasses.replace(
            result,
            reason=f"{result.reason}; {count} position(s) that rounding alone decides "
            "are not compared",
        )
    return result


@dataclasses.dataclass(frozen=True)
class OperatorVerdict:
    """What one operator test judged: a candidate on a case, one result per output. The
    operator suite records it (``records``) and fails with ``message``, as the model suites
    do with ``ModelVerdict``."""

    candidate: Candidate
    case: Case
    results: tuple[CompareResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def records(self, test_id: str, **context: Any) -> list[DriftRecord]:
        """One record per output (``context``: suite, candidate, device, case, timings)."""
        return [DriftRecord.from_result(r, test_id=test_id, **context) for r in self.results]

    def message(self) -> str:
        """The failure message: the candidate and case, then every failing output's."""
        c, case = self.candidate, self.case
        return f"candidate {c.name!r} ({c.module}) on case {case.name} [{case.regime}]:\n" + (
            "\n\n".join(r.message() for r in self.results if not r.passed)
        )


def _zero_where(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` with the positions of ``mask`` set to zero (``mask`` moved to ``t``'s device)."""
    return t.masked_fill(mask.to(t.device), 0)


def candidate_function(
    op: Operator, candidate: Candidate, compiled: CompileSpec | None
) -> Callable[..., Any]:
    """The candidate's function, or with ``compiled`` its compiled form (a
    ``CompiledFunction``, kept per worker: every case and dtype of the candidate reuses it;
    its ``stats`` hold the compile time and graph breaks not yet taken by a test)."""
    if compiled is None:
        return candidate.fn
    from numalign.runtime.compiled import compiled_function

    what = f"candidate {candidate.name!r} of {op.name} ({candidate.module})"
    return compiled_function(candidate.fn, compiled, what)
