"""What each verdict rule allowed, typed: the budget of a decision (its limits, where they
came from and why), and the decision itself. ``CompareResult.budget`` holds a budget's
``limits()``, the dict records and reports read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ControlBudget:
    """Rule "budget": limits that are multiples of a same-dtype control's errors.

    ``max_abs = max_abs_multiplier * control_tail + floor + accumulation`` and ``rel_l2 =
    rel_l2_multiplier * control_rel_l2 + eps + accumulation_rel``; ``source`` is "control"
    (the control run now) or "calibration" (a golden set's calibrated control errors)."""

    max_abs: float
    max_abs_multiplier: float
    control_max_abs: float
    control_tail: float
    floor: float
    accumulation: float
    rel_l2: float
    rel_l2_multiplier: float
    control_rel_l2: float
    eps: float
    accumulation_rel: float
    source: str = "control"
    why: str = (
        "an honest kernel's error is a multiple of the control's; the floors are one ulp of "
        "the output and eps, the accumulation allowance sqrt(K) roundings of the accumulator"
    )

    def limits(self) -> dict[str, float]:
        return {
            "max_abs": self.max_abs,
            "max_abs_multiplier": self.max_abs_multiplier,
            "control_max_abs": self.control_max_abs,
            "control_tail": self.control_tail,
            "floor": self.floor,
            "accumulation": self.accumulation,
            "rel_l2": self.rel_l2,
            "rel_l2_multiplier": self.rel_l2_multiplier,
            "control_rel_l2": self.control_rel_l2,
            "eps": self.eps,
            "accumulation_rel": self.accumulation_rel,
        }


@dataclass(frozen=True)
class ToleranceBudget:
    """Rules "tolerance" and "ties": ``|actual - expected| <= atol + rtol * |expected|``;
    ``reduction_length`` when the table's atol was scaled by its square root. ``source``:
    "explicit" (the caller's), "table" (the (dtype, operator class) table), "dtype" (the
    dtype's row, for tied scores) or the pyproject override that gave it."""

    rtol: float
    atol: float
    reduction_length: int | None = None
    source: str = "table"
    why: str = "no control: the dtype's tolerance, loosened by the operator class"

    def limits(self) -> dict[str, float]:
        out = {"rtol": self.rtol, "atol": self.atol}
        if self.reduction_length:
            out["reduction_length"] = float(self.reduction_length)
        return out


@dataclass(frozen=True)
class ExactBudget:
    """Rule "exact": integer, boolean or index outputs may differ by at most ``atol`` (0:
    not at all)."""

    atol: float = 0.0
    source: str = "exact"
    why: str = "integers, booleans and indices have one right value"

    def limits(self) -> dict[str, float]:
        return {"atol": self.atol}


@dataclass(frozen=True)
class DistributionBudget:
    """Rule "distribution": how far the norm ratio may deviate from 1 (``norm``), how far
    the cosine may fall below 1 (``cosine``), the share of excess exact zeros (``zeros``),
    or how far a systematic scale may exceed the control's (``scale``); None where that
    part did not decide. ``source`` says what set them: "table", "calibration" (either
    relaxed by the control or by the truth rounded to the dtype), "rounding zeros", "zero
    reach" or "systematic scale"."""

    norm: float | None = None
    cosine: float | None = None
    zeros: float | None = None
    scale: float | None = None
    source: str = "table"
    why: str = (
        "values within their budget but abnormal: a systematic scale, a turned direction, "
        "or outputs flushed to zero"
    )

    def limits(self) -> dict[str, float]:
        parts = {"norm": self.norm, "cosine": self.cosine, "zeros": self.zeros}
        return {k: v for k, v in (parts | {"scale": self.scale}).items() if v is not None}


@dataclass(frozen=True)
class RoundingBudget:
    """Rule "rounding": in steps of the codes' grid at x / scale, the worst element's
    distance, the share rounded to the farther neighbour and the mean bias allowed."""

    max_step_error_limit: float
    off_by_one_share_limit: float
    bias_limit_steps: float
    source: str = "rule"
    why: str = "round to nearest leaves the nearest grid point only at ties"

    def limits(self) -> dict[str, float]:
        return {
            "max_step_error_limit": self.max_step_error_limit,
            "off_by_one_share_limit": self.off_by_one_share_limit,
            "bias_limit_steps": self.bias_limit_steps,
        }


RuleBudget = ControlBudget | ToleranceBudget | ExactBudget | DistributionBudget | RoundingBudget


@dataclass(frozen=True)
class Decision:
    """One rule's verdict: the rule (of ``compare.result.RULES``), whether the output
    passes it, why (``reason`` and, for a failure, ``hint``), how much of its allowance the
    worst measure used (``used``; above 1 fails) and the allowance (``budget``)."""

    rule: str
    passed: bool
    reason: str
    hint: str | None = None
    used: float = 0.0
    budget: RuleBudget | None = None
