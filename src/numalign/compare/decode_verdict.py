"""The decode verdict: the points and cache states of every decode step, the logits of every
step, and the first divergence (a ``Divergence`` of kind ``decode``: named by step and point),
each judged within the set's decode calibration (``compare.model_verdict``). Replay
(``replay.decode``) runs the steps and hands the pairs here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from numalign.compare.calibration import OUTPUT_POINT
from numalign.compare.model_verdict import DecodeLocation, Divergence, LogitsResult, PointResult

#: The order of a failing step's logits: after every point of every step (``_decode_order``).
_AFTER_EVERY_POINT = 1 << 30


@dataclass
class DecodeVerdict:
    """Everything a decode replay judged: the points and cache states of every step, the
    logits of every step, and the first divergence."""

    implementation: str
    points: list[PointResult] = field(default_factory=list)
    logits: list[LogitsResult] = field(default_factory=list)
    #: points an engine has no counterpart for, with the reason (skipped records)
    unmapped: dict[str, str] = field(default_factory=dict)
    #: where the first divergence lives (``replay.decode_locate.locate_decode``)
    location: DecodeLocation | None = None

    @property
    def first_failing(self) -> PointResult | None:
        """The first failing point result (in step and forward order), not the logits."""
        failing = [r for r in self.points if not r.result.passed]
        return min(failing, key=_decode_order) if failing else None

    @property
    def divergence(self) -> Divergence | None:
        failing = [r for r in self.points if not r.result.passed]
        failing += [  # a step whose logits fail with every point within budget
            PointResult(OUTPUT_POINT, _AFTER_EVERY_POINT, lg.request, "logits", lg.values,
                        "decode", finished=_AFTER_EVERY_POINT, step=lg.step)
            for lg in self.logits
            if not lg.passed and lg.values is not None
        ]  # fmt: skip
        if not failing:
            return None
        first = min(failing, key=_decode_order)
        location = self.location if first is self.first_failing else None
        return Divergence(first.label, "decode", first.request, first.result, step=first.step,
                          location=location)  # fmt: skip

    @property
    def passed(self) -> bool:
        return self.divergence is None and all(lg.passed for lg in self.logits)

    def is_divergent(self, result: PointResult, divergence: Divergence | None) -> bool:
        """Whether ``result`` is the point result ``divergence`` names (its record carries
        the first divergence)."""
        return divergence is not None and (result.step, result.label, result.request) == (
            divergence.step, divergence.point, divergence.request,
        )  # fmt: skip

    def message(self, title: str) -> str:
        problems = [self.divergence.describe()] if self.divergence is not None else []
        problems += [
            f"logits of {lg.request} at decode step {lg.step}: " + "; ".join(lg.problems)
            for lg in self.logits
            if not lg.passed
        ]
        return f"{title} [{self.implementation} cache]: " + "\n\n".join(problems)


def _decode_order(r: PointResult) -> tuple[float, int]:
    """Step, then completion order; a pooled lean (no step) only after every step's own
    results, in forward order (the cache's states, written by the attention, after every
    point)."""
    return (math.inf, r.order) if r.step is None else (r.step, r.finished)
