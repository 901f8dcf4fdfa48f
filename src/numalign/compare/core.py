"""compare() and assert_aligned(): the verdict rules (docs/comparison.md).

Rules, in order, one function each: shape (``_shape``); non-finite positions
(``_non_finite``); exact (integers, booleans, indices) or tie-aware selection
(``compare.exact``); the error budget against a same-dtype control, or the (dtype, operator
class) table without one (``compare.measure``, then ``_within_budget``); the distribution of
values (``compare.distribution``). Each returns its ``Decision`` with its typed budget
(``compare.budgets``); a quantizer's rounding is judged by ``compare.rounding``. What a
comparison is asked besides the two tensors is a ``CompareSpec`` (``compare.spec``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from numalign.compare.budgets import ControlBudget, Decision
from numalign.compare.cause import Cause, exact_cause, float_cause, unexplained
from numalign.compare.distribution import (
    ScaleRule,
    judge_distribution,
    judge_systematic_scale,
    planted_limits,
    scale_rule,
)
from numalign.compare.exact import judge_exact, judge_mask
from numalign.compare.measure import Measured, measure
from numalign.compare.metrics import Metrics
from numalign.compare.power import Detectable, detectable
from numalign.compare.result import CompareResult
from numalign.compare.spec import CompareSpec
from numalign.compare.tolerances import FLOAT_FORMATS, Budget, Tolerance
from numalign.core.dtypes import dtype_name

if TYPE_CHECKING:
    import torch

__all__ = ["assert_aligned", "compare", "dtype_name"]


def compare(
    actual: torch.Tensor, expected: torch.Tensor, spec: CompareSpec = CompareSpec()
) -> CompareResult:
    """Compares a candidate output with the truth and returns every metric and a verdict.

    Args:
        actual: the candidate's output, any dtype and device.
        expected: the truth (float64 reference or golden tensor), same shape; a boolean
            truth against a candidate that is not boolean is a mask (where each position
            attends), judged by ``exact.judge_mask``: where the candidate attends, and an
            additive candidate's fill.
        spec: the terms of the comparison (``CompareSpec``: the operator class, a control or
            its calibrated errors, ties, an explicit tolerance or budget, the name, the
            policy, ...); the default judges an elementwise output against the table.
    """
    import torch

    dtype = dtype_name(actual.dtype)
    mask = expected.dtype == torch.bool and actual.dtype != torch.bool
    exact = mask or not actual.is_floating_point() or spec.ties is not None
    _check_dtype(spec.name, dtype, exact)
    result = _Builder(spec, dtype, tuple(actual.shape))
    shape = _shape(actual, expected)
    if shape is not None:
        result.metrics = _blank(result.shape)
        return result.conclude(shape)
    _check_control(spec.name, spec.control, actual, expected)
    if exact:
        return _compare_exact(actual, expected, spec, result, mask=mask)
    return _compare_float(actual, expected, spec, result)


def assert_aligned(
    actual: torch.Tensor, expected: torch.Tensor, spec: CompareSpec = CompareSpec()
) -> CompareResult:
    """``compare()`` that raises ``AssertionError`` with the formatted result when the
    candidate is not aligned; returns the result otherwise (to record it)."""
    __tracebackhide__ = True
    result = compare(actual, expected, spec)
    if not result.passed:
        raise AssertionError(result.message())
    return result


def _compare_exact(
    actual: torch.Tensor,
    expected: torch.Tensor,
    spec: CompareSpec,
    result: _Builder,
    *,
    mask: bool,
) -> CompareResult:
    """An output judged exactly: a mask (``mask``) by where it attends, integers, booleans
    and indices by rule "exact", a selection among tied scores (``spec.ties``) by "ties"."""
    decision, result.metrics = (
        judge_mask(actual, expected, name=spec.name)
        if mask
        else judge_exact(actual, expected, ties=spec.ties, tolerance=spec.tolerance, name=spec.name)
    )
    budget_of = decision.budget
    result.budget = budget_of.limits() if budget_of is not None else {}
    selection = spec.ties is not None or spec.op_class == "selection"
    result.cause = exact_cause(decision, mask=mask, selection=selection)
    return result.conclude(decision)


def _compare_float(
    actual: torch.Tensor, expected: torch.Tensor, spec: CompareSpec, result: _Builder
) -> CompareResult:
    """A floating output: its errors against the budget or tolerance (``measure``), then
    rules "non-finite", "budget" or "tolerance" and "distribution"; a failure's likely cause
    read from its error (it never changes the verdict)."""
    dtype = result.dtype
    measured = measure(actual, expected, spec)
    result.metrics, result.control = measured.metrics, measured.control
    result.budget = measured.budget.limits()
    calibrated = spec.control_errors is not None and spec.control_errors.calibrated
    scale = _scale(actual, expected, measured, spec, dtype)
    result.detectable = _power(actual, expected, measured, scale, dtype, calibrated=calibrated,
                               propagated=spec.propagated)  # fmt: skip
    decision = _non_finite(measured) or _within_budget(actual, expected, measured)
    if decision is None:
        decision = _distribution(
            actual, expected, measured, spec.control, scale, dtype,
            calibrated=calibrated, zero_reach=spec.zero_reach, propagated=spec.propagated,
        )  # fmt: skip
    decision = decision or _within(measured)
    if not decision.passed:
        result.cause = float_cause(actual, expected, spec.control, decision, dtype, spec.op_class)
    return result.conclude(decision)


def _scale(
    actual: torch.Tensor,
    expected: torch.Tensor,
    measured: Measured,
    spec: CompareSpec,
    dtype: str,
) -> ScaleRule | None:
    """The systematic-scale rule's measures against a control run now, for the rule and for
    the verdict's power; None without one."""
    if spec.control is None:
        return None
    widen = max(1.0, measured.spread / Budget().rel_l2_multiplier)  # an override widens it too
    return scale_rule(
        actual, expected, spec.control, dtype, spec.reduction_length, widen, spec.exponent_reach
    )


class _Builder:
    """Collects the parts of a CompareResult while the rules run."""

    def __init__(self, spec: CompareSpec, dtype: str, shape: tuple[int, ...]) -> None:
        self.name, self.dtype, self.shape, self.op_class = spec.name, dtype, shape, spec.op_class
        self.metrics: Metrics | None = None
        self.control: Metrics | None = None
        self.budget: dict[str, float] = {}
        self.detectable: Detectable | None = None
        self.cause: Cause | None = None

    def conclude(self, decision: Decision) -> CompareResult:
        """The result of the deciding rule: a failure uses at least its whole budget."""
        assert self.metrics is not None
        used = decision.used
        if not decision.passed and math.isfinite(used):
            used = max(used, 1.0)
        return CompareResult(
            name=self.name,
            dtype=self.dtype,
            shape=self.shape,
            op_class=self.op_class,
            passed=decision.passed,
            rule=decision.rule,
            reason=decision.reason,
            metrics=self.metrics,
            control=self.control,
            budget=self.budget,
            budget_used=used,
            hint=None if decision.passed else decision.hint,
            detectable=self.detectable,
            cause=None if decision.passed else self.cause or unexplained(decision),
        )


def _check_dtype(name: str, dtype: str, exact: bool) -> None:
    """Raises ValueError for a floating dtype outside ``FLOAT_FORMATS`` (the operator class
    is checked by ``CompareSpec``)."""
    if not exact and dtype not in FLOAT_FORMATS:
        raise ValueError(
            f"{name}: unsupported dtype {dtype!r}; supported floating dtypes: "
            f"{', '.join(FLOAT_FORMATS)}, and integer or boolean dtypes (compared exactly)."
        )


def _check_control(
    name: str, control: torch.Tensor | None, actual: torch.Tensor, expected: torch.Tensor
) -> None:
    """Raises ValueError for a control of another shape than the truth's or another dtype
    than the candidate's."""
    if control is None:
        return
    if control.shape != expected.shape:
        raise ValueError(
            f"{name}: control shape {tuple(control.shape)} != reference shape "
            f"{tuple(expected.shape)}; the control is the reference run in the candidate dtype"
        )
    if control.dtype != actual.dtype:
        raise ValueError(
            f"{name}: control dtype {dtype_name(control.dtype)} != candidate dtype "
            f"{dtype_name(actual.dtype)}; the control must run in the same dtype as the candidate"
        )


def _shape(actual: torch.Tensor, expected: torch.Tensor) -> Decision | None:
    """Rule "shape": the candidate's shape is the truth's."""
    if actual.shape == expected.shape:
        return None
    return Decision(
        "shape", False,
        f"shape {tuple(actual.shape)} differs from the reference's {tuple(expected.shape)}",
        "check the output layout (transposes, head and sequence order) and dropped or "
        "padded tails",
        used=math.inf,
    )  # fmt: skip


def _blank(shape: tuple[int, ...]) -> Metrics:
    """The metrics of an output that could not be compared: every element mismatched."""
    return Metrics.blank(
        math.prod(shape), error=math.nan, agreement=math.nan, mismatch_count=math.prod(shape)
    )


def _non_finite(measured: Measured) -> Decision | None:
    """Rule "non-finite": NaN and Inf where the truth has them, nowhere else."""
    found = _nonfinite_reason(measured.metrics)
    if found is None:
        return None
    reason, hint = found
    return Decision("non-finite", False, reason, hint, measured.used, measured.budget)


def _within_budget(
    actual: torch.Tensor, expected: torch.Tensor, measured: Measured
) -> Decision | None:
    """The failing decision of rule "budget" (max abs, then relative L2) or "tolerance"
    (any element beyond it); None when the errors are within."""
    m, b, used = measured.metrics, measured.budget, measured.used
    if isinstance(b, ControlBudget):
        if m.max_abs > b.max_abs:
            return Decision(
                "budget", False,
                f"max abs error {_g(m.max_abs)} exceeds the budget {_g(b.max_abs)} "
                f"({_times_control(m.max_abs, b)})",
                _error_hint(actual, expected, b.max_abs, None, m), used, b,
            )  # fmt: skip
        if m.rel_l2 > b.rel_l2:
            return Decision(
                "budget", False,
                f"relative L2 error {_g(m.rel_l2)} exceeds the budget {_g(b.rel_l2)}",
                _error_hint(actual, expected, None, None, m), used, b,
            )  # fmt: skip
        return None
    if not m.mismatch_count:
        return None
    return Decision(
        "tolerance", False,
        f"{m.mismatch_count} element(s) exceed atol + rtol * |expected|, "
        f"worst by {_g(m.tolerance_ratio, 3)}x",
        _error_hint(actual, expected, None, Tolerance(rtol=b.rtol, atol=b.atol), m), used, b,
    )  # fmt: skip


def _distribution(
    actual: torch.Tensor,
    expected: torch.Tensor,
    measured: Measured,
    control: torch.Tensor | None,
    scale: ScaleRule | None,
    dtype: str,
    *,
    calibrated: bool,
    zero_reach: float | None,
    propagated: bool,
) -> Decision | None:
    """Rule "distribution" (``compare.distribution``): the norm, direction and zeros, then,
    against a control run now, a systematic scale (``scale``: its measures); the failure
    uses the larger of the budget's use and how far the distribution is past its limit."""
    b = measured.budget
    decision = judge_distribution(
        actual, expected, measured.metrics, measured.control, measured.spread, dtype,
        calibrated=b if calibrated and isinstance(b, ControlBudget) else None,
        zero_reach=zero_reach, propagated=propagated,
    )  # fmt: skip
    if decision is None and control is not None and scale is not None:
        decision = judge_systematic_scale(scale, dtype)
    if decision is None:
        return None
    return replace(decision, used=max(measured.used, decision.used))


def _power(
    actual: torch.Tensor,
    expected: torch.Tensor,
    measured: Measured,
    scale: ScaleRule | None,
    dtype: str,
    *,
    calibrated: bool,
    propagated: bool,
) -> Detectable | None:
    """The smallest scale and bias the rules of this comparison would have caught
    (``compare.power``), from the limits they hold a candidate to: the budget's or the
    tolerance's, the distribution rule's (where it judges: some element was compared) and
    the systematic scale's (against a control run now)."""
    b = measured.budget
    limits = None
    if measured.metrics.numel and measured.metrics.worst_index is not None:
        limits = planted_limits(
            expected, actual.dtype, measured.control, measured.spread, dtype,
            calibrated=b if calibrated and isinstance(b, ControlBudget) else None,
            propagated=propagated,
        )  # fmt: skip
    return detectable(expected, b, distribution=limits, scale=scale)


def _within(measured: Measured) -> Decision:
    """The passing decision: every rule held."""
    rule = "budget" if isinstance(measured.budget, ControlBudget) else "tolerance"
    reason = f"within budget (worst use {_g(measured.used, 3)})"
    return Decision(rule, True, reason, used=measured.used, budget=measured.budget)


def _times_control(error: float, budget: ControlBudget) -> str:
    if budget.control_max_abs > 0:
        return f"{_g(error / budget.control_max_abs, 3)}x the control's error"
    return f"{_g(error / budget.floor, 3)} ulp; the control is exact here"


def _g(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}g}"


def _nonfinite_reason(m: Metrics) -> tuple[str, str] | None:
    if m.nonfinite_index is None:
        return None
    where = "(" + ", ".join(str(i) for i in m.nonfinite_index) + ")"
    if m.nan_actual > m.nan_expected or (m.nan_actual and m.nan_actual != m.nan_expected):
        return (
            f"a NaN appears at {where} where the reference is finite",
            f"a NaN appears at {where} where the reference is finite: check fully masked rows "
            "(softmax over all -inf must give zeros), 0/0 and sqrt or log of negative values",
        )
    if m.inf_actual > m.inf_expected:
        return (
            f"an Inf appears at {where} where the reference is finite",
            "check overflow: accumulation in a narrow dtype (float16 ends at 65504), a missing "
            "max subtraction before exp, or a division by a value that underflowed",
        )
    return (
        f"the non-finite values differ from the reference's at {where}",
        f"the reference is NaN or Inf at {where} where the candidate differs: the candidate "
        "hides an invalid value or changes its sign; NaN and Inf positions must match exactly",
    )


def _error_hint(
    actual: torch.Tensor,
    expected: torch.Tensor,
    threshold: float | None,
    tolerance: Tolerance | None,
    m: Metrics,
) -> str:
    """Where the errors are, said so that it points at a cause."""
    import torch

    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    err = (a - e).abs().nan_to_num(0.0)
    if tolerance is not None:
        bad = err > tolerance.atol + tolerance.rtol * e.abs()
    elif threshold is not None:
        bad = err > threshold
    else:
        bad = err > err.mean() + 3 * err.std() if err.numel() > 1 else err > 0
    # The error along the truth's direction, over the whole error (both relative to ||e||):
    # with a = s e + r, <d, e> = s - 1 and ||d||**2 = (s - 1)**2 + ||r||**2.
    along = m.cosine * m.norm_ratio - 1.0
    if m.rel_l2 > 0 and math.isfinite(m.rel_l2) and along**2 > 0.75 * m.rel_l2**2:
        return (
            f"the error is mostly a scale (norm ratio {_g(m.norm_ratio, 6)}, relative L2 error "
            f"{_g(m.rel_l2)}): check epsilon, scaling factors and accumulation precision "
            "(accumulate reductions in float32)"
        )
    if bad.any() and a.dim() > 0:
        where = bad.nonzero()
        for dim in range(a.dim() - 1, -1, -1):
            first = int(where[:, dim].min())
            size = a.shape[dim]
            tail = bad.narrow(dim, first, size - first)
            # A boundary only when most of what lies past it is wrong.
            if first > 0 and size > 1 and float(tail.double().mean()) > 0.5:
                return (
                    f"every mismatch lies at index >= {first} of dim {dim} (size {size}): check "
                    "tails past a tile, chunk, window or page boundary"
                )
    return (
        "check accumulation precision (accumulate reductions in float32), epsilon and masks; "
        f"the worst element is at {m.worst_index}"
    )
