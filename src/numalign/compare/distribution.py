"""Rule "distribution": values within their budget but abnormal fail. A norm ratio or a
cosine beyond what the dtype (or the control, or the calibration) explains, exact zeros
beyond what rounding explains, and a systematic scale shared by many elements."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from numalign.compare.budgets import ControlBudget, Decision, DistributionBudget
from numalign.compare.metrics import (
    Metrics,
    compute_metrics,
    count_rounding_zeros,
    float_format,
    rounding_control,
    signed_percent,
)
from numalign.compare.tolerances import (
    CALIBRATED_DISTRIBUTION_FLOORS,
    DISTRIBUTION_THRESHOLDS,
    FLOAT_FORMATS,
    SCALE_ACCUMULATOR_ROUNDOFFS,
    SCALE_EXPONENT_ROUNDOFFS,
    SCALE_MIN_ELEMENTS,
    SCALE_OUTPUT_ROUNDOFFS,
    SCALE_Z,
    ZERO_EXCESS_COUNT,
    ZERO_EXCESS_FRACTION,
)

if TYPE_CHECKING:
    import torch


class _Limits(NamedTuple):
    """The norm and cosine limits while they are worked out, and what set them."""

    norm: float
    cosine: float
    source: str

    def budget(self) -> DistributionBudget:
        return DistributionBudget(self.norm, self.cosine, source=self.source)


_FLUSHED_HINT = (
    "outputs flushed to zero: check underflow (flush-to-zero, a missing upcast) and skipped "
    "tiles or rows"
)


def judge_distribution(
    actual: torch.Tensor,
    expected: torch.Tensor,
    m: Metrics,
    control: Metrics | None,
    spread: float,
    dtype: str,
    *,
    calibrated: ControlBudget | None = None,
    zero_reach: float | None = None,
    propagated: bool = False,
) -> Decision | None:
    """Rule 4: values within tolerance but abnormal fail (a failing decision; None passes).

    Against a calibrated control (a golden set's calibration, which records the control's
    norm ratio, cosine and zeros; ``calibrated`` is the budget built from it) the limits
    are relative to the control, with the floors the dtype explains. An error of relative L2
    r moves a norm by at most r and a cosine by at most r**2 / 2, so the norm ratio may also
    deviate by the control's whole relative error (plus the budget's accumulation allowance),
    and 1 - cosine by half the square of the relative L2 budget: a systematic scale is flagged
    when it exceeds everything the control's own error explains. Otherwise, the dtype's
    thresholds, relaxed by the control. The decision's ``used`` is the deviation over its
    limit."""
    if m.numel == 0 or m.worst_index is None:
        return None
    floors = _floors(dtype, calibrated, propagated)
    references = [control] if control is not None else []
    limits = _relaxed(floors, references, spread, "control")
    if _off(m, limits) and control is None:
        # No control: the truth rounded to the dtype is the least error any kernel has;
        # outputs that cancel (tiny norm) or sit among subnormals relax the thresholds.
        references.append(compute_metrics(rounding_control(expected, actual.dtype), expected))
        limits = _relaxed(floors, references, spread, "rounding control")
    against = references[0] if calibrated is not None and references else None
    return _norm_or_direction(m, limits, against) or _zeros(
        actual, expected, m, control, zero_reach
    )


def planted_limits(
    expected: torch.Tensor,
    dtype_of: torch.dtype,
    control: Metrics | None,
    spread: float,
    dtype: str,
    *,
    calibrated: ControlBudget | None = None,
    propagated: bool = False,
) -> tuple[float, float]:
    """The limits ``judge_distribution`` holds a candidate to once its norm or direction
    is off, as (|norm ratio - 1|, 1 - cosine): its floors relaxed by the control, and
    without a control by the truth rounded to ``dtype_of`` too (the relaxation it makes
    for a candidate that is off, as one carrying a planted error is). ``compare.power``
    reads what the rule would have caught from them."""
    floors = _floors(dtype, calibrated, propagated)
    references = [control] if control is not None else []
    if control is None:
        references.append(compute_metrics(rounding_control(expected, dtype_of), expected))
        limits = _relaxed(floors, references, spread, "rounding control")
    else:
        limits = _relaxed(floors, references, spread, "control")
    return limits.norm, limits.cosine


def calibrated_limits(
    control: Metrics, spread: float, dtype: str, calibrated: ControlBudget, propagated: bool
) -> DistributionBudget:
    """The norm and cosine limits ``judge_distribution`` holds a candidate to against a
    calibrated ``control`` (its metrics as the calibration recorded them), for a point
    judged without its golden tensor (``compare.statistics``)."""
    return _relaxed(_floors(dtype, calibrated, propagated), [control], spread, "control").budget()


def _floors(dtype: str, calibrated: ControlBudget | None, propagated: bool) -> _Limits:
    """The dtype's thresholds, or against a calibration its floors widened by what an error
    as large as the calibrated control's explains."""
    if calibrated is None:
        norm_tol, cos_tol = DISTRIBUTION_THRESHOLDS[dtype]
        return _Limits(norm_tol, cos_tol, "table")
    norm_tol, cos_tol = CALIBRATED_DISTRIBUTION_FLOORS[dtype]
    b = calibrated
    # an error of relative L2 r moves a norm by at most r: a point alone by the control's
    # own error (a systematic scale beyond it is the point's), a point fed by upstream
    # honest differences by as much error of the control's kind as the budget allows
    # (its multiplier times the control's; not the eps floor, which stands for the
    # candidate's own extra roundings, unbiased: they cannot move a norm). A scaled norm
    # still fails where little error comes from upstream (docs/golden-sets.md).
    control_kind = b.rel_l2_multiplier if propagated else 1.0
    norm_tol = max(norm_tol, control_kind * b.control_rel_l2 + b.accumulation_rel)
    cos_tol = max(cos_tol, b.rel_l2**2 / 2)
    return _Limits(norm_tol, cos_tol, "calibration")


def _relaxed(floors: _Limits, references: list[Metrics], spread: float, what: str) -> _Limits:
    """The floors, relaxed to ``spread`` times each reference's own deviation."""
    n_tol, c_tol = floors.norm, floors.cosine
    for ref in references:
        n_tol = max(n_tol, spread * abs(ref.norm_ratio - 1.0))
        c_tol = max(c_tol, spread**2 * (1.0 - ref.cosine))
    source = f"{floors.source}, relaxed by the {what}" if references else floors.source
    return _Limits(n_tol, c_tol, source)


def _off(m: Metrics, limits: _Limits) -> bool:
    return abs(m.norm_ratio - 1.0) > limits.norm or 1.0 - m.cosine > limits.cosine


def _norm_or_direction(
    m: Metrics, limits: _Limits, calibrated_control: Metrics | None
) -> Decision | None:
    """A norm ratio or a cosine beyond ``limits``."""
    n_tol, c_tol = limits.norm, limits.cosine
    if abs(m.norm_ratio - 1.0) > n_tol:
        small = f" (the reference's largest magnitude is {_g(m.max_expected)})"
        against = (
            f", the calibrated control's {_g(calibrated_control.norm_ratio, 6)}"
            if calibrated_control is not None
            else ""
        )
        return Decision(
            "distribution", False,
            f"values are within tolerance but the norm ratio is {_g(m.norm_ratio, 6)}, off by more "
            f"than {_g(n_tol, 3)}{small}{against}",
            "a systematic scale error: check epsilon (it dominates small inputs), a missing "
            "or doubled scale, and outputs flushed to zero",
            used=abs(m.norm_ratio - 1.0) / n_tol if n_tol > 0 else math.inf, budget=limits.budget(),
        )  # fmt: skip
    if 1.0 - m.cosine > c_tol:
        return Decision(
            "distribution", False,
            f"values are within tolerance but the cosine similarity is {_g(m.cosine, 8)}, below "
            f"1 - {_g(c_tol, 3)}",
            "the output's direction differs from the reference: check permuted or mixed-up "
            "channels, heads or positions",
            used=(1.0 - m.cosine) / c_tol if c_tol > 0 else math.inf, budget=limits.budget(),
        )  # fmt: skip
    return None


def _zeros(
    actual: torch.Tensor,
    expected: torch.Tensor,
    m: Metrics,
    control: Metrics | None,
    zero_reach: float | None,
) -> Decision | None:
    """Exact zeros of the candidate beyond what chance explains: beyond ``zero_reach`` where
    it is given, else beyond the zeros of the truth rounded to the dtype (or the control's)."""
    if not m.zero_fraction_actual > 0:
        return None
    if zero_reach is not None:
        return _zeros_beyond_reach(actual, expected, m.numel, zero_reach)
    if float_format(actual.dtype) is None:
        return None
    expected_zero = count_rounding_zeros(expected, actual.dtype) / max(m.numel, 1)
    if control is not None:
        expected_zero = max(expected_zero, control.zero_fraction_actual)
    excess = m.zero_fraction_actual - expected_zero
    allowed = _zero_allowance(m.numel)
    if not excess > allowed:
        return None
    return Decision(
        "distribution", False,
        f"{100 * m.zero_fraction_actual:.1f}% of the values are exactly zero where the "
        f"reference rounds to zero at {100 * expected_zero:.1f}%",
        _FLUSHED_HINT, used=excess / allowed,
        budget=DistributionBudget(zeros=allowed, source="rounding zeros"),
    )  # fmt: skip


def _zero_allowance(numel: int) -> float:
    """The share of excess exact zeros allowed: ``ZERO_EXCESS_FRACTION``, or
    ``ZERO_EXCESS_COUNT`` elements of a small output."""
    return max(ZERO_EXCESS_FRACTION, ZERO_EXCESS_COUNT / max(numel, 1))


def _zeros_beyond_reach(
    actual: torch.Tensor, expected: torch.Tensor, numel: int, reach: float
) -> Decision | None:
    """Exact zeros of the candidate where the reference lies beyond ``reach`` (what honest
    error and one rounding can bring onto zero): more than the allowance fail."""
    a = actual.detach().reshape(-1)
    e = expected.detach().reshape(-1).to(a.device)
    suspicious = int(((a == 0) & e.isfinite() & (e.abs() > reach)).sum())
    allowed = _zero_allowance(numel)
    excess = suspicious / max(numel, 1)
    if excess <= allowed:
        return None
    return Decision(
        "distribution", False,
        f"{suspicious} of {numel} values ({100 * excess:.1f}%) are exactly zero where the "
        f"reference lies beyond {_g(reach)}, farther from zero than honest error and one "
        "rounding reach",
        _FLUSHED_HINT, used=excess / allowed,
        budget=DistributionBudget(zeros=allowed, source="zero reach"),
    )  # fmt: skip


def _slope(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float, int]:
    """The error's regression on the truth through zero, d = beta * e + r: (beta, its
    heteroscedasticity-robust standard error, elements), over the finite elements."""
    import torch

    a = actual.detach().reshape(-1).to(torch.float64)
    e = expected.detach().reshape(-1).to(torch.float64).to(a.device)
    keep = a.isfinite() & e.isfinite()
    a, e = a[keep], e[keep]
    ee = float(e @ e)
    if ee == 0.0 or not math.isfinite(ee):
        return 0.0, math.inf, int(e.numel())
    d = a - e
    beta = float(d @ e) / ee
    r = d - beta * e
    return beta, math.sqrt(float((e * e) @ (r * r))) / ee, int(e.numel())


class ScaleRule(NamedTuple):
    """What the systematic-scale rule measures of a candidate: its lean (the slope of its
    error on the truth) and the lean's standard error over ``elements`` finite elements,
    the control's lean, and the floor the lean must exceed the control's by."""

    lean: float
    se: float
    elements: int
    control: float
    floor: float


def scale_rule(
    actual: torch.Tensor,
    expected: torch.Tensor,
    control: torch.Tensor,
    dtype: str,
    reduction_length: int | None,
    widen: float = 1.0,
    exponent_reach: float | None = None,
) -> ScaleRule | None:
    """The systematic-scale rule's measures (``judge_systematic_scale``); None with fewer
    than ``SCALE_MIN_ELEMENTS`` finite elements, where the rule does not judge."""
    beta, se, n = _slope(actual, expected)
    if n < SCALE_MIN_ELEMENTS:
        return None
    beta_c, _, _ = _slope(control, expected)
    roundoff = 2.0 ** -FLOAT_FORMATS[dtype][0] / 2
    acc = 2.0 ** -FLOAT_FORMATS["float64" if dtype == "float64" else "float32"][0] / 2
    walk = math.sqrt(reduction_length) if reduction_length and reduction_length > 1 else 0.0
    reach = SCALE_EXPONENT_ROUNDOFFS * exponent_reach if exponent_reach else 0.0
    floor = widen * max(
        max(SCALE_ACCUMULATOR_ROUNDOFFS, walk, reach) * acc, SCALE_OUTPUT_ROUNDOFFS * roundoff
    )
    return ScaleRule(beta, se, n, beta_c, floor)


def judge_systematic_scale(rule: ScaleRule, dtype: str) -> Decision | None:
    """A scale shared by many elements, resolved below one rounding per element: the
    candidate's slope of error on truth (``scale_rule``'s measures), judged by its standard
    error (``SCALE_Z``) and by how much it exceeds the control's own lean (the floors of
    ``tolerances.SCALE_*``, times ``widen``; for an output through exponentials,
    ``exponent_reach`` times ``SCALE_EXPONENT_ROUNDOFFS`` of the accumulator)."""
    beta, se, n, beta_c, floor = rule.lean, rule.se, rule.elements, rule.control, rule.floor
    # how much more the candidate leans than the control (a candidate closer to the truth
    # than a control that rounds a shared scale, say, leans less and passes)
    shift = abs(beta) - abs(beta_c)
    z = abs(beta) / se if se > 0 else (math.inf if beta else 0.0)
    if z <= SCALE_Z or shift <= floor:
        return None
    return Decision(
        "distribution", False,
        f"values are within the budget but share a systematic scale of {signed_percent(beta)} "
        f"across {n} elements ({_g(z, 3)} standard errors; the control's "
        f"{signed_percent(beta_c)}), beyond "
        f"what honest rounding leans ({_g(floor, 3)} in {dtype})",
        "a systematic scale below one rounding per element: check accumulation precision "
        "(a sum of squares or a normalizer accumulated in the input dtype), epsilon, and "
        "rounding that truncates instead of rounding to nearest",
        used=shift / floor,
        budget=DistributionBudget(scale=floor, source="systematic scale"),
    )  # fmt: skip


def _g(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}g}"
