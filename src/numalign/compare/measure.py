"""Rule "budget" or "tolerance": the limits a floating output is held to and its errors
measured against them (``measure``), for ``compare()``'s later rules to read."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from numalign.compare.budgets import ControlBudget, ToleranceBudget
from numalign.compare.metrics import ControlErrors, Metrics, compute_metrics, error_tail
from numalign.compare.policy import DEFAULT_POLICY, TolerancePolicy
from numalign.compare.tolerances import FLOAT_FORMATS, Budget, Tolerance
from numalign.core.dtypes import dtype_name

if TYPE_CHECKING:
    import torch

    from numalign.compare.spec import CompareSpec

__all__ = ["Measured", "measure"]


@dataclass(frozen=True)
class Measured:
    """The errors of a floating output against the truth, measured against the budget or
    tolerance that applies (rule "budget" or "tolerance"): the budget's use, and the spread
    the distribution rule relaxes by (the relative L2 multiplier)."""

    metrics: Metrics
    budget: ControlBudget | ToleranceBudget
    used: float
    spread: float
    control: Metrics | None = None


def measure(actual: torch.Tensor, expected: torch.Tensor, spec: CompareSpec) -> Measured:
    """The errors of a floating ``actual`` against the truth ``expected`` (same shape), held
    to multiples of the control's errors where ``spec`` gives a control or its calibrated
    errors (rule "budget"), else to the explicit or the table's tolerance (rule "tolerance");
    ``spec.policy``'s overrides apply, the built-in tables without one."""
    policy = spec.policy or DEFAULT_POLICY
    if spec.control is not None or spec.control_errors is not None:
        return _control_budget(
            actual, expected, spec.control, spec.control_errors, spec.reduction_length,
            spec.name, policy, spec.budget,
        )  # fmt: skip
    return _table_tolerance(
        actual, expected, spec.tolerance, spec.reduction_length, spec.name, spec.op_class,
        policy, spec.budget,
    )  # fmt: skip


def _control_budget(
    actual: torch.Tensor,
    expected: torch.Tensor,
    control: torch.Tensor | None,
    control_errors: ControlErrors | None,
    reduction_length: int | None,
    name: str,
    policy: TolerancePolicy,
    default: Budget | None,
) -> Measured:
    """Rule "budget": limits that are multiples of the control's errors (``control`` run
    now, else the calibrated ``control_errors``), and the candidate's errors against them."""
    dtype = dtype_name(actual.dtype)
    tail = None
    if control is not None:
        control_metrics = compute_metrics(control, expected)
        tail = error_tail(control, expected)  # the worst error of a fresh draw
    else:
        assert control_errors is not None
        control_metrics = control_errors.as_metrics(expected)
    b = control_budget(dtype, control_metrics, tail, reduction_length, name, policy, default,
                       "control" if control is not None else "calibration")  # fmt: skip
    metrics = compute_metrics(actual, expected, threshold=b.max_abs)
    used = max(_over(metrics.max_abs, b.max_abs), _over(metrics.rel_l2, b.rel_l2))
    return Measured(metrics, b, used, b.rel_l2_multiplier, control_metrics)


def control_budget(
    dtype: str,
    control_metrics: Metrics,
    tail: float | None,
    reduction_length: int | None,
    name: str,
    policy: TolerancePolicy,
    default: Budget | None,
    source: str,
) -> ControlBudget:
    """Rule "budget"'s limits from a control's errors (``control_metrics``, its worst
    fresh draw ``tail`` where the control ran now): multiples of them plus the floors;
    ``source`` says whether the control ran now or comes from a calibration."""
    fmt = FLOAT_FORMATS[dtype]
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
        source=source
        + (f", multipliers from the {overridden}" if overridden else "")
        + (", the operator's own multipliers" if default is not None and not overridden else ""),
    )  # fmt: skip
    return b


def _table_tolerance(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tolerance: Tolerance | None,
    reduction_length: int | None,
    name: str,
    op_class: str,
    policy: TolerancePolicy,
    default: Budget | None,
) -> Measured:
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
    return Measured(metrics, b, metrics.tolerance_ratio, spread)


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


def _over(value: float, limit: float) -> float:
    return value / limit if limit > 0 else (0.0 if value == 0 else math.inf)
