"""Power: the smallest systematic error a verdict would have caught.

A pass says the candidate is within its budget; what the pass is worth is how small an error
the same rules would still have failed. Two errors stand for the systematic kind, each
planted on a candidate as honest as the one judged (its noise, none of its own lean):

- ``scale``: a relative scale s, the candidate ``truth * (1 + s)``;
- ``bias``: an additive offset of b times the truth's root mean square, the candidate
  ``truth + b * rms(truth)``.

Each figure is the least size beyond which the error fails, of either sign, computed from
each rule's own limit as this comparison computed it (``docs/comparison.md``, "Power"),
the minimum over the rules that judge the comparison, then the larger over the two signs:

============== ================================= =========================================
rule           scale s fails beyond              bias b (in RMS) fails beyond
============== ================================= =========================================
budget max abs ``max_abs / max|e|``              ``max_abs / rms``
budget rel L2  ``rel_l2``                        ``rel_l2``
tolerance      ``rtol + atol / max|e|``          ``(atol + rtol * min|e|) / rms``
norm ratio     ``norm``                          ``-m + sqrt(m**2 + 2 norm + norm**2)``
cosine         never (a scale keeps direction)   where ``1 - cos(b) = cosine``
systematic     ``max(Z se, |lean_c| + floor)``   ``max(Z se / sqrt(m**2 - Z**2 A),
scale                                            (|lean_c| + floor) / |m|)``
pooled lean    ``limit_scale``                   ``limit_offset`` (``lean.lean_limit``)
============== ================================= =========================================

with e the truth, m its mean over its RMS (signed by the bias's sign), ``norm`` and
``cosine`` the distribution rule's limits (``distribution.planted_limits``), Z
``SCALE_Z``, se the candidate's own lean's standard error (a planted scale does not move it:
the residual is the same), ``lean_c`` the control's lean and ``floor`` the rule's
(``distribution.scale_rule``), A the squared standard error a bias of 1 adds to the lean
(the residual a constant leaves about its own projection on the truth). The norm figure is
where the norm ratio leaves its limit for good (a bias against the truth's mean first
shrinks the norm and then grows it); the cosine falls monotonically towards ``m``, never
failing where ``1 - m`` is within its limit. A figure of infinity says no error of that
kind fails (an all-zero truth cannot be scaled).

The figures leave out the candidate's own noise, which only makes a planted error fail
sooner (the max-abs rule meets the noise's worst element as well), so they are the power
of the rules at the truth; exact, selection, mask and rounding outputs have none
(``None``): their rules are not about a size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from numalign.compare.budgets import ControlBudget, ToleranceBudget
from numalign.compare.tolerances import SCALE_Z

if TYPE_CHECKING:
    import torch

    from numalign.compare.calibration import ControlStats
    from numalign.compare.distribution import ScaleRule
    from numalign.compare.lean import Lean
    from numalign.compare.tolerances import Thresholds

__all__ = ["Detectable", "detectable", "lean_detectable"]


@dataclass(frozen=True)
class Detectable:
    """The smallest systematic errors a verdict would have caught, of either sign:
    ``scale`` relative (the candidate ``truth * (1 + scale)``), ``bias`` in units of the
    truth's RMS (the candidate ``truth + bias * rms``); infinity where none would."""

    scale: float
    bias: float

    def to_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "bias": self.bias}


@dataclass(frozen=True)
class _Truth:
    """What the figures need of the truth's finite elements: their count, largest and
    smallest magnitude, RMS, mean over RMS (``m``) and the lean variance a unit bias adds
    (``a``, see the module's docstring)."""

    n: int
    largest: float
    smallest: float
    rms: float
    m: float
    a: float


def _truth(expected: torch.Tensor) -> _Truth | None:
    """The truth's statistics over its finite elements, in float64; None without one."""
    import torch

    e = expected.detach().reshape(-1).to(torch.float64)
    e = e[e.isfinite()]
    n = int(e.numel())
    if n == 0:
        return None
    ee = e * e
    s2 = float(ee.sum())
    magnitude = e.abs()
    largest, smallest = float(magnitude.max()), float(magnitude.min())
    rms = math.sqrt(s2 / n)
    if s2 <= 0.0 or not math.isfinite(s2):
        return _Truth(n, largest, smallest, rms, 0.0, 0.0)
    m = float(e.sum()) / n / rms
    s3, s4 = float((ee * e).sum()), float((ee * ee).sum())
    # the residual a bias b leaves about its projection on e: b (rms - m e); its weighted
    # square over (e . e)**2 is the lean's squared standard error it adds, per unit b**2
    a = max(rms * rms * s2 - 2.0 * m * rms * s3 + m * m * s4, 0.0) / (s2 * s2)
    return _Truth(n, largest, smallest, rms, m, a)


def _over(limit: float, unit: float) -> float:
    """``limit / unit``: infinite where the unit is zero (no error of that kind exists)."""
    return limit / unit if unit > 0 and math.isfinite(unit) else math.inf


def _norm_bias(m: float, limit: float) -> float:
    """The bias beyond which the norm ratio sqrt(1 + 2 m b + b**2) stays more than
    ``limit`` from 1 (its largest root of sqrt(...) = 1 + limit)."""
    return -m + math.sqrt(m * m + 2.0 * limit + limit * limit)


def _cosine_bias(m: float, limit: float) -> float:
    """The bias where 1 - cos(b) reaches ``limit``; cos(b) = (1 + m b) / sqrt(1 + 2 m b
    + b**2) falls monotonically from 1 towards m: infinite where 1 - m is within it."""
    # 1 - cos is measured in float64, where a cosine below 1 is at most 1 - 2**-53: a
    # smaller limit (float64's table, 1e-20) fails nothing closer to 1 than that
    limit = max(limit, 2.0**-53)
    # cos(b) = c squared: (m**2 - c**2) b**2 + 2 m q b + q = 0, q = 1 - c**2, the root
    # where 1 + m b >= 0 (the other squares a cosine of -c)
    c = 1.0 - limit
    if m >= c:
        return math.inf
    q = limit * (2.0 - limit)  # 1 - c**2, without the cancellation
    root = c * math.sqrt(q * max(1.0 - m * m, 0.0))
    a = c * c - m * m
    if a > 0.0:
        return (m * q + root) / a
    if a == 0.0:  # m = -c
        return -1.0 / (2.0 * m)
    return (-m * q - root) / -a


def _systematic_bias(t: _Truth, rule: ScaleRule) -> float:
    """The bias the systematic-scale rule catches: it leans the output by b m, with a
    standard error grown to sqrt(se**2 + b**2 a); it fails once that lean is ``SCALE_Z``
    standard errors and beyond the control's lean by the floor."""
    lean = abs(t.m)
    if lean == 0.0:
        return math.inf
    excess = lean * lean - SCALE_Z * SCALE_Z * t.a
    if excess <= 0.0:
        return math.inf  # a constant leans too little against its own residual
    significant = SCALE_Z * rule.se / math.sqrt(excess)
    return max(significant, (abs(rule.control) + rule.floor) / lean)


def detectable(
    expected: torch.Tensor,
    budget: ControlBudget | ToleranceBudget,
    *,
    distribution: tuple[float, float] | None = None,
    scale: ScaleRule | None = None,
) -> Detectable | None:
    """The smallest scale and bias the comparison's rules would have caught (the module's
    table): ``budget`` the budget or tolerance that applied, ``distribution`` the
    distribution rule's (norm, cosine) limits where it judges, ``scale`` the systematic-
    scale rule's measures where it judges. None for a truth without a finite element."""
    t = _truth(expected)
    if t is None:
        return None
    scales: list[float] = []
    biases: list[float] = []  # the rules alike for both signs
    if isinstance(budget, ControlBudget):
        scales += [_over(budget.max_abs, t.largest), budget.rel_l2 if t.rms > 0 else math.inf]
        biases += [_over(budget.max_abs, t.rms), budget.rel_l2 if t.rms > 0 else math.inf]
    else:
        scales.append(budget.rtol + _over(budget.atol, t.largest))
        biases.append(_over(budget.atol + budget.rtol * t.smallest, t.rms))
    if scale is not None:
        scales.append(max(SCALE_Z * scale.se, abs(scale.control) + scale.floor))
        if t.rms > 0:
            biases.append(_systematic_bias(t, scale))
    signed = [math.inf, math.inf]  # the rules that differ with the bias's sign
    if distribution is not None:
        norm, cosine = distribution
        scales.append(norm if t.rms > 0 else math.inf)
        if t.rms > 0:
            signed = [min(_norm_bias(s * t.m, norm), _cosine_bias(s * t.m, cosine))
                      for s in (1.0, -1.0)]  # fmt: skip
    either = min(biases, default=math.inf)
    bias = max(min(either, s) for s in signed)
    return Detectable(scale=_finite_or_inf(min(scales)), bias=_finite_or_inf(bias))


def lean_detectable(
    measured: Lean,
    calibration: ControlStats,
    dtype: str = "bfloat16",
    reduction: int = 1,
    thresholds: Thresholds | None = None,
    upstream: float | None = None,
) -> Detectable | None:
    """The smallest scale and offset (in RMS) the pooled lean rule (``compare.lean``)
    would have caught on ``measured``'s elements: its global leans' limits
    (``lean.lean_limit``); infinity for a lean the calibration holds no range of, None
    where it holds neither."""
    from numalign.compare.lean import lean_limit

    limits = [
        lean_limit(name, measured, calibration, dtype, reduction, thresholds, upstream)
        for name in ("scale", "offset")
    ]
    if all(limit is None for limit in limits):
        return None
    scale, bias = (math.inf if limit is None else limit for limit in limits)
    return Detectable(scale=scale, bias=bias)


def _finite_or_inf(value: float) -> float:
    """A figure as stored: NaN (a limit that is not a number) reads as nothing caught."""
    return math.inf if math.isnan(value) else value
