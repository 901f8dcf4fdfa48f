"""The ratchet: budgets that loosened and verdicts that lost power since a baseline run.

A regression (``report.baseline``) is a candidate that moved. The ratchet watches the judge
instead: a record's budget (the limits its rule held the candidate to) and its power (the
smallest scale and bias a pass would have caught, ``compare.power``) against the same
record of the baseline. A budget that grows, or a power figure that grows (a pass that now
sees less), passes silently in the verdicts: a recalibrated set, a changed tolerance table
or policy, a borrowed control. The nightly reports each beyond ``RATCHET_FACTOR`` in its
own line; it does not fail the run (a recaptured set may loosen a budget for a reason: the
line says which sets were recaptured).

Limits compared (``LIMITS``): the ones a rule measures a candidate against, never their
parts (a multiplier, a control's figure, a floor), so that one cause counts once; a lean's
interval (``scale_low`` to ``scale_high``, ``offset_low`` to ``offset_high``) by its width.
Rows are grouped per test, point, output and measure: a loosened point calibration moves the
records of every request and step of it, and is one line.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from numalign.compare import tolerances
from numalign.records.drift import DriftRecord

#: A budget or a power figure moved beyond this factor is reported (its reason there).
RATCHET_FACTOR = tolerances.RATCHET_FACTOR
#: Budget keys that bound a candidate's error directly (larger: looser), per rule: the
#: calibrated budget (max_abs, rel_l2), the tolerance (atol, rtol), the distribution rule
#: (norm, cosine, zeros, scale), rounding's three limits, the logits' KL, the continuation's
#: near tie and a routing's allowed flips.
LIMITS: tuple[str, ...] = (
    "max_abs", "rel_l2", "atol", "rtol", "norm", "cosine", "zeros", "scale",
    "max_step_error_limit", "off_by_one_share_limit", "bias_limit_steps",
    "kl_max", "near_tie", "flips_allowed",
)  # fmt: skip
#: Intervals a lean is held within, compared by their width: (name, low key, high key).
INTERVALS: tuple[tuple[str, str, str], ...] = (
    ("scale_range", "scale_low", "scale_high"),
    ("offset_range", "offset_low", "offset_high"),
)
#: Power figures (``DriftRecord.detectable``).
POWER: tuple[str, ...] = ("scale", "bias")


@dataclass
class _Moved:
    """The worst growth of one measure at one test, point and output, and how many of its
    records grew beyond the factor."""

    record: DriftRecord
    measure: str
    baseline: float
    now: float
    recaptured: bool
    records: int = 1

    @property
    def growth(self) -> float:
        return self.now / self.baseline if self.baseline > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        r = self.record
        return {
            "test_id": r.test_id, "point": r.point, "output": r.output, "dtype": r.dtype,
            "measure": self.measure, "baseline": self.baseline, "now": self.now,
            "growth": self.growth, "records": self.records, "recaptured": self.recaptured,
        }  # fmt: skip


def budget_limits(record: DriftRecord) -> dict[str, float]:
    """The limits of ``record``'s budget the ratchet compares (``LIMITS``, ``INTERVALS``)."""
    budget = record.budget or {}
    out = {k: float(budget[k]) for k in LIMITS if _number(budget.get(k))}
    for name, low, high in INTERVALS:
        if _number(budget.get(low)) and _number(budget.get(high)):
            out[name] = float(budget[high]) - float(budget[low])
    return out


def power_figures(record: DriftRecord) -> dict[str, float]:
    """The record's power figures (``POWER``), infinite ones included (none caught)."""
    found = record.detectable if isinstance(record.detectable, dict) else {}
    return {k: float(found[k]) for k in POWER if _number(found.get(k), finite=False)}


def ratchet(
    pairs: Iterable[tuple[DriftRecord, DriftRecord]], factor: float = RATCHET_FACTOR
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(loosened, weakened)`` over matched ``(current, baseline)`` record pairs: the
    budget limits and the power figures grown beyond ``factor``, one row per test, point,
    output and measure (its worst growth and the count of its records that grew), the
    largest growth first."""
    if factor <= 1.0:
        raise ValueError(f"the ratchet factor must be above 1, got {factor}")
    loosened: dict[tuple[str, ...], _Moved] = {}
    weakened: dict[tuple[str, ...], _Moved] = {}
    for now, before in pairs:
        recaptured = now.golden_fingerprint != before.golden_fingerprint
        for found, read in ((loosened, budget_limits), (weakened, power_figures)):
            old_values, new_values = read(before), read(now)
            for measure in old_values.keys() & new_values.keys():
                moved = _Moved(now, measure, old_values[measure], new_values[measure], recaptured)
                if not _grew(moved.baseline, moved.now, factor):
                    continue
                key = (now.test_id, str(now.point), str(now.output), measure)
                kept = found.get(key)
                if kept is None:
                    found[key] = moved
                    continue
                kept.records += 1
                if moved.growth > kept.growth:
                    moved.records = kept.records
                    found[key] = moved
    return _rows(loosened.values()), _rows(weakened.values())


def ratchet_line(diff: dict[str, Any]) -> str:
    """The ratchet's one line from a baseline diff's dict (``BaselineDiff.to_dict``, as
    regressions.json keeps it): how many points' budgets loosened and how many lost power
    beyond its factor, the largest growth of each, and the sets recaptured where any moved."""

    def part(rows: list[dict[str, Any]], what: str) -> str:
        points = len({(r["test_id"], r["point"], r["output"]) for r in rows})
        counted = f"{points} point{'' if points == 1 else 's'} {what}"
        return f"{counted} (up to {growth_text(rows[0])})" if rows else counted

    loosened, weakened = diff.get("loosened") or [], diff.get("weakened") or []
    factor = diff.get("ratchet_factor", RATCHET_FACTOR)
    line = (
        f"ratchet: {part(loosened, 'with a budget loosened')}, "
        f"{part(weakened, 'that lost power')} beyond {factor:g}x"
    )
    recaptured = diff.get("recaptured") or []
    if recaptured and (loosened or weakened):
        line += f"; recaptured since the baseline: {', '.join(recaptured)}"
    return line


def ratchet_lines(diff: dict[str, Any], shown: int) -> list[str]:
    """The ratchet as the terminal and the nightly print it: its line (``ratchet_line``),
    then up to ``shown`` rows of each kind (``ratchet_row``)."""
    lines = [ratchet_line(diff)]
    for kind, key in (("loosened", "loosened"), ("lost power", "weakened")):
        lines += [f"  {kind} {ratchet_row(row)}" for row in (diff.get(key) or [])[:shown]]
    return lines


def ratchet_row(row: dict[str, Any]) -> str:
    """One ratchet row as the terminal and the nightly print it: ``1.6x  max_abs 2.1e-05 ->
    3.4e-05 (12 records, recaptured)  TEST :: POINT``."""
    where = f"{row['test_id']} :: {row['point']}" + (
        f" [{row['output']}]" if row["output"] not in (None, "None", "0") else ""
    )
    extra = f"{row['records']} records" + (", recaptured" if row["recaptured"] else "")
    return (
        f"{growth_text(row)}  {row['measure']} {row['baseline']:.3g} -> {row['now']:.3g} "
        f"({extra})  {where}"
    )


def growth_text(row: dict[str, Any]) -> str:
    """A row's growth as the ratchet's lines write it: "1.6x"; "from 0" where the baseline's
    figure was zero (a lean range of width zero that opened); "to inf" where the figure now
    catches nothing."""
    if math.isinf(row["now"]):
        return "to inf"
    if row["baseline"] <= 0:
        return "from 0"
    return f"{row['growth']:.3g}x"


def _grew(before: float, now: float, factor: float) -> bool:
    if math.isinf(before):
        return False  # nothing was caught before: a figure cannot lose what it lacked
    if math.isinf(now):
        return True
    return now > factor * before if before > 0 else now > 0


def _rows(moved: Iterable[_Moved]) -> list[dict[str, Any]]:
    ranked = sorted(moved, key=lambda m: (-m.growth, m.record.test_id, m.measure))
    return [m.to_dict() for m in ranked]


def _number(value: Any, *, finite: bool = True) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return False
    return math.isfinite(value) or not finite
