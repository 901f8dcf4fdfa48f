"""compare() and assert_aligned(): the verdict rules (docs/comparison.md).

Rules, in order, one function each: shape (``_shape``); non-finite positions
(``_non_finite``); exact (integers, booleans, indices) or tie-aware selection
(``compare.exact``); the error budget against a same-dtype control, or the (dtype, operator
class) table without one (``_control_budget`` or ``_table_tolerance``, then
``_within_budget``); the distribution of values (``compare.distribution``). Each returns its
``Decision`` with its typed budget (``compare.budgets``); a quantizer's rounding is judged
by ``compare.rounding``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from numalign.compare.budgets import ControlBudget, Decision, ToleranceBudget
from numalign.compare.cause import Cause, exact_cause, float_cause, unexplained
from numalign.compare.distribution import (
    ScaleRule,
    judge_distribution,
    judge_systematic_scale,
    planted_limits,
    scale_rule,
)
from numalign.compare.exact import judge_exact, judge_mask
from numalign.compare.metrics import (
    ControlErrors,
    Metrics,
    compute_metrics,
    error_tail,
)
from numalign.compare.power import Detectable, detectable
from numalign.compare.result import CompareResult
from numalign.compare.tolerances import (
    DEFAULT_POLICY,
    FLOAT_FORMATS,
    OP_CLASSES,
    Budget,
    Tolerance,
    TolerancePolicy,
)
from numalign.dtypes import dtype_name
from numalign.names import did_you_mean

if TYPE_CHECKING:
    import torch

__all__ = ["assert_aligned", "compare", "dtype_name"]


def compare(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    op_class: str = "elementwise",
    control: torch.Tensor | None = None,
    control_errors: ControlErrors | None = None,
    reduction_length: int | None = None,
    ties: torch.Tensor | None = None,
    tolerance: Tolerance | None = None,
    budget: Budget | None = None,
    name: str = "output",
    policy: TolerancePolicy | None = None,
    zero_reach: float | None = None,
    propagated: bool = False,
    exponent_reach: float | None = None,
) -> CompareResult:
    """Compares a candidate output with the truth and returns every metric and a verdict.

    Args:
        actual: the candidate's output, any dtype and device.
        expected: the truth (float64 reference or golden tensor), same shape; a boolean
            truth against a candidate that is not boolean is a mask (where each position
            attends), judged by ``exact.judge_mask``: where the candidate attends, and an
            additive candidate's fill.
        op_class: one of ``OP_CLASSES``; picks the table row when there is no control.
        control: the honest reference computed in ``actual``'s dtype; when given, the error
            budget is a multiple of the control's error against ``expected`` (rule 3).
        control_errors: the control's errors when only they are known (a golden set's
            calibration): used as ``control`` is.
        reduction_length: length of the reduction behind each output element; scales the
            table's atol by its square root (reduction classes only).
        ties: for index outputs (top-k, sort), the scores the indices select from along the
            last dimension; indices may then differ where the scores tie within tolerance.
        tolerance: an explicit elementwise tolerance, replacing the table (and, for integer
            outputs, allowing ``atol`` of difference, e.g. 1 for rounding ties).
        budget: the control multipliers when no pyproject override matches (an operator's
            own, where its honest alternatives round differently by design).
        name: the operator or capture point, for messages and pyproject overrides.
        policy: overrides from ``[tool.numalign]``; the built-in tables when None.
        zero_reach: the reference magnitude up to which an exact zero in the candidate is
            chance (an honest value rounded onto zero); exact zeros then count against the
            distribution rule only where the reference lies beyond it, position by position.
        propagated: the candidate's error includes what honest differences upstream carried
            into it (a point of the whole model, a decode step): against a calibration, its
            norm may then move as far as its relative L2 budget allows, not only as far as
            the control's own error (an isolated point's systematic scale is judged alone).
        exponent_reach: for an output computed through exponentials (a softmax), the
            farthest an exponent's argument lies below its row's maximum (natural units):
            a kernel folding a constant rounded to its accumulator into the exponent leans
            the output by up to that many of the constant's roundings, which the systematic
            scale's floor takes in (``Operator.exponent_reach``).
    """
    policy = policy or DEFAULT_POLICY
    import torch

    dtype = dtype_name(actual.dtype)
    mask = expected.dtype == torch.bool and actual.dtype != torch.bool
    exact = mask or not actual.is_floating_point() or ties is not None
    _check_arguments(name, op_class, dtype, exact)
    result = _Builder(name=name, dtype=dtype, shape=tuple(actual.shape), op_class=op_class)
    shape = _shape(actual, expected)
    if shape is not None:
        result.metrics = _blank(result.shape)
        return result.conclude(shape)
    _check_control(name, control, actual, expected)
    if exact:
        exact_decision, result.metrics = (
            judge_mask(actual, expected, name=name)
            if mask
            else judge_exact(actual, expected, ties=ties, tolerance=tolerance, name=name)
        )
        budget_of = exact_decision.budget
        result.budget = budget_of.limits() if budget_of is not None else {}
        result.cause = exact_cause(exact_decision, mask=mask, selection=ties is not None
                                    or op_class == "selection")  # fmt: skip
        return result.conclude(exact_decision)
    if control is not None or control_errors is not None:
        measured = _control_budget(
            actual, expected, control, control_errors, reduction_length, name, policy, budget
        )
    else:
        measured = _table_tolerance(
            actual, expected, tolerance, reduction_length, name, op_class, policy, budget
        )
    result.metrics, result.control = measured.metrics, measured.control
    result.budget = measured.budget.limits()
    calibrated = control_errors is not None and control_errors.calibrated
    scale = None
    if control is not None:  # the systematic-scale rule's measures, for it and for power
        widen = measured.spread / Budget().rel_l2_multiplier  # a budget override widens it too
        scale = scale_rule(actual, expected, control, dtype, reduction_length, max(1.0, widen),
                           exponent_reach)  # fmt: skip
    result.detectable = _power(actual, expected, measured, scale, dtype, calibrated=calibrated,
                               propagated=propagated)  # fmt: skip
    decision = _non_finite(measured) or _within_budget(actual, expected, measured)
    if decision is None:
        decision = _distribution(
            actual, expected, measured, control, scale, dtype,
            calibrated=calibrated, zero_reach=zero_reach, propagated=propagated,
        )  # fmt: skip
    decision = decision or _within(measured)
    if not decision.passed:  # a cause explains a failure; it never changes the verdict
        result.cause = float_cause(actual, expected, control, decision, dtype, op_class)
    return result.conclude(decision)


def assert_aligned(
    actual: torch.Tensor,
    expected: torch.Tensor,
    **kwargs: object,
) -> CompareResult:
    """``compare()`` that raises ``AssertionError`` with the formatted result when the
    candidate is not aligned; returns the result otherwise (to record it)."""
    __tracebackhide__ = True
    result = compare(actual, expected, **kwargs)  # type: ignore[arg-type]
    if not result.passed:
        raise AssertionError(result.message())
    return result


@dataclass(frozen=True)
class _Measured:
    """The errors of a floating output against the truth, measured against the budget or
    tolerance that applies (rule "budget" or "tolerance"): the budget's use, and the spread
    the distribution rule relaxes by (the relative L2 multiplier)."""

    metrics: Metrics
    budget: ControlBudget | ToleranceBudget
    used: float
    spread: float
    control: Metrics | None = None


class _Builder:
    """Collects the parts of a CompareResult while the rules run."""

    def __init__(self, *, name: str, dtype: str, shape: tuple[int, ...], op_class: str) -> None:
        self.name, self.dtype, self.shape, self.op_class = name, dtype, shape, op_class
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


def _check_arguments(name: str, op_class: str, dtype: str, exact: bool) -> None:
    """Raises ValueError for an unknown operator class or an unsupported floating dtype."""
    if op_class not in OP_CLASSES:
        raise ValueError(
            f"Unknown operator class {op_class!r}; allowed: {', '.join(OP_CLASSES)}."
            + did_you_mean(op_class, OP_CLASSES)
        )
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


def _control_budget(
    actual: torch.Tensor,
    expected: torch.Tensor,
    control: torch.Tensor | None,
    control_errors: ControlErrors | None,
    reduction_length: int | None,
    name: str,
    policy: TolerancePolicy,
    default: Budget | None,
) -> _Measured:
    """Rule "budget": limits that are multiples of the control's errors (``control`` run
    now, else the calibrated ``control_errors``), and the candidate's errors against them."""
    dtype = dtype_name(actual.dtype)
    fmt = FLOAT_FORMATS[dtype]
    tail = None
    if control is not None:
        control_metrics = compute_metrics(control, expected)
        tail = error_tail(control, expected)  # the worst error of a fresh draw
    else:
        assert control_errors is not None
        control_metrics = control_errors.as_metrics(expected)
    multipliers = policy.budget(name, dtype, default)
    # Floors: one ulp of the output at its largest magnitude, and, for a reduction of
    # length K, sqrt(K) roundings of the accumulator (float32; float64 for float64) at that
    # magnitude: honest kernels sum in other orders than the control, and sequential sums
    # drift as sqrt(K). The accumulator's rounding is its relative spacing times the
    # magnitude, not the ulp there: partial sums cross the power of two the largest output
    # lies under, and the ulp's step would halve the allowance for a draw just below it.
    walk = math.sqrt(reduction_length) if reduction_length and reduction_length > 1 else 0.0
    acc_fmt = FLOAT_FORMATS["float64" if dtype == "float64" else "float32"]
    floor = _ulp(control_metrics.max_expected, fmt)
    acc_rounding = _spacing(control_metrics.max_expected, acc_fmt)
    worst = max(control_metrics.max_abs, tail or 0.0)
    overridden = policy.source("budget", name, dtype)
    b = ControlBudget(
        max_abs=multipliers.max_abs_multiplier * worst + floor + walk * acc_rounding,
        max_abs_multiplier=multipliers.max_abs_multiplier, control_max_abs=control_metrics.max_abs,
        control_tail=worst, floor=floor,
        accumulation=walk * acc_rounding,
        rel_l2=multipliers.rel_l2_multiplier * control_metrics.rel_l2 + 2.0 ** -fmt[0]
        + walk * 2.0 ** -acc_fmt[0],
        rel_l2_multiplier=multipliers.rel_l2_multiplier, control_rel_l2=control_metrics.rel_l2,
        eps=2.0 ** -fmt[0], accumulation_rel=walk * 2.0 ** -acc_fmt[0],
        source=("control" if control is not None else "calibration")
        + (f", multipliers from the {overridden}" if overridden else "")
        + (", the operator's own multipliers" if default is not None and not overridden else ""),
    )  # fmt: skip
    metrics = compute_metrics(actual, expected, threshold=b.max_abs)
    used = max(_over(metrics.max_abs, b.max_abs), _over(metrics.rel_l2, b.rel_l2))
    return _Measured(metrics, b, used, multipliers.rel_l2_multiplier, control_metrics)


def _table_tolerance(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tolerance: Tolerance | None,
    reduction_length: int | None,
    name: str,
    op_class: str,
    policy: TolerancePolicy,
    default: Budget | None,
) -> _Measured:
    """Rule "tolerance": without a control, the explicit ``tolerance`` or the (dtype,
    operator class) table's (a pyproject override's where one matches)."""
    dtype = dtype_name(actual.dtype)
    tol = tolerance or policy.tolerance(name, dtype, op_class, reduction_length)
    metrics = compute_metrics(actual, expected, tolerance=tol)
    scaled = tolerance is None and reduction_length is not None and reduction_length > 1
    source = "explicit" if tolerance is not None else policy.source("tolerance", name, dtype)
    b = ToleranceBudget(
        tol.rtol, tol.atol, reduction_length if scaled else None, source=source or "table"
    )
    spread = policy.budget(name, dtype, default).rel_l2_multiplier
    return _Measured(metrics, b, metrics.tolerance_ratio, spread)


def _non_finite(measured: _Measured) -> Decision | None:
    """Rule "non-finite": NaN and Inf where the truth has them, nowhere else."""
    found = _nonfinite_reason(measured.metrics)
    if found is None:
        return None
    reason, hint = found
    return Decision("non-finite", False, reason, hint, measured.used, measured.budget)


def _within_budget(
    actual: torch.Tensor, expected: torch.Tensor, measured: _Measured
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
    measured: _Measured,
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
    measured: _Measured,
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


def _within(measured: _Measured) -> Decision:
    """The passing decision: every rule held."""
    rule = "budget" if isinstance(measured.budget, ControlBudget) else "tolerance"
    reason = f"within budget (worst use {_g(measured.used, 3)})"
    return Decision(rule, True, reason, used=measured.used, budget=measured.budget)


def _ulp(magnitude: float, fmt: tuple[int, int]) -> float:
    """One ulp of the format at ``magnitude``."""
    if magnitude <= 0 or not math.isfinite(magnitude):
        return 2.0 ** fmt[1]
    return max(2.0 ** (math.floor(math.log2(magnitude)) - fmt[0]), 2.0 ** fmt[1])


def _spacing(magnitude: float, fmt: tuple[int, int]) -> float:
    """One rounding of the format near ``magnitude``, continuous in it: the relative spacing
    2**-mantissa times the magnitude, between the ulp at the magnitude and the ulp of the
    binade above (at least the ulp there; the ulp itself for zero or non-finite values)."""
    if magnitude <= 0 or not math.isfinite(magnitude):
        return _ulp(magnitude, fmt)
    return max(magnitude * 2.0 ** -fmt[0], _ulp(magnitude, fmt))


def _times_control(error: float, budget: ControlBudget) -> str:
    if budget.control_max_abs > 0:
        return f"{_g(error / budget.control_max_abs, 3)}x the control's error"
    return f"{_g(error / budget.floor, 3)} ulp; the control is exact here"


def _over(value: float, limit: float) -> float:
    return value / limit if limit > 0 else (0.0 if value == 0 else math.inf)


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
