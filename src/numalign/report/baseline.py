"""Regressions against a baseline run: records matched by their key (test id, point, request,
output path, step, and the point's call after its first)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from numalign.compare import tolerances
from numalign.records.drift import DriftRecord
from numalign.report.ratchet import RATCHET_FACTOR, ratchet
from numalign.session.option_values import DEFAULT_REGRESSION_FACTOR

#: Growth below this use of the budget is not reported (its reason: compare.tolerances).
NOISE_FLOOR = tolerances.NOISE_FLOOR


@dataclass
class BaselineDiff:
    """What changed between a baseline run and this one."""

    factor: float
    compared: int = 0
    regressed: list[dict[str, Any]] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    vanished: list[str] = field(default_factory=list)
    #: golden sets (model names) recaptured since the baseline: their records compare a new
    #: golden version, and what moved is the model, not the kernels
    recaptured: list[str] = field(default_factory=list)
    #: the ratchet (``report.ratchet``): budgets loosened and power lost beyond its factor
    loosened: list[dict[str, Any]] = field(default_factory=list)
    weakened: list[dict[str, Any]] = field(default_factory=list)
    ratchet_factor: float = RATCHET_FACTOR

    def to_dict(self) -> dict[str, Any]:
        return {
            "factor": self.factor,
            "compared": self.compared,
            "regressed": self.regressed,
            "new": self.new,
            "vanished": self.vanished,
            "recaptured": self.recaptured,
            "loosened": self.loosened,
            "weakened": self.weakened,
            "ratchet_factor": self.ratchet_factor,
        }


def diff_runs(
    current: list[DriftRecord],
    baseline: list[DriftRecord],
    factor: float = DEFAULT_REGRESSION_FACTOR,
    *,
    noise_floor: float = NOISE_FLOOR,
) -> BaselineDiff:
    """Flags records whose budget use grew beyond ``factor`` times the baseline's (above
    ``noise_floor``, overridable in ``[tool.numalign.thresholds]``), or that passed in the
    baseline and fail or crash now, even while others still pass; a record of an expected
    failure (xfailed) is never flagged. Lists keys new in this run and keys that vanished
    from it. Runs the ratchet over the matched records (``report.ratchet``)."""
    if factor <= 1.0:
        raise ValueError(f"the regression factor must be above 1, got {factor}")
    before = {r.key: r for r in baseline if r.verdict != "skipped"}
    now = {r.key: r for r in current if r.verdict != "skipped"}
    diff = BaselineDiff(factor=factor)
    for key, record in now.items():
        old = before.get(key)
        if old is None:
            diff.new.append(key)
            continue
        diff.compared += 1
        if record.golden_fingerprint != old.golden_fingerprint:
            diff.recaptured.append(str(record.model or record.golden_fingerprint))
        used, old_used = record.used, old.used
        # an expected failure (xfailed) is not a regression: pytest does not fail on it
        expected = record.status == "xfailed"
        newly_failing = old.verdict == "passed" and record.verdict != "passed" and not expected
        grew = (
            not expected
            and used is not None
            and old_used is not None
            and used > noise_floor
            and used > factor * old_used
        )
        if newly_failing or grew:
            diff.regressed.append(
                {
                    "key": key,
                    "test_id": record.test_id,
                    "point": record.point,
                    "request": record.request,
                    "dtype": record.dtype,
                    "baseline_budget_used": old_used,
                    "budget_used": used,
                    "growth": (used / old_used) if used is not None and old_used else None,
                    "baseline_verdict": old.status,
                    "verdict": record.status,
                }
            )
    diff.loosened, diff.weakened = ratchet(
        (record, before[key]) for key, record in now.items() if key in before
    )
    diff.vanished = sorted(set(before) - set(now))
    diff.recaptured = sorted(set(diff.recaptured))
    diff.regressed.sort(key=lambda r: -(r["growth"] or float("inf")))
    return diff
