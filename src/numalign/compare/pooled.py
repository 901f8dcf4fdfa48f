"""The pooled lean rule of the model suites: a capture point's outputs pooled over every request and
call (and decode step), and their leans (``compare.lean``) judged against the range the set's
isolated calibration reached in the same dtype. A pooled lean resolves a systematic error far
below one rounding per element (a norm 0.3% too large in bfloat16), which the
per-comparison budgets, at the dtype's noise, let through.

In layer replay (mode ``isolated``) the outputs are the module's alone on the golden inputs.
In the whole model (``accumulated``) and in decode (``decode``: every step pooled, step None)
they are the point's as the model runs, and the honest range is widened by the ensemble's
relative L2 error of the point in that mode (``compare.lean``: the lean honest upstream error
can bring), the global leans judged, not the per-channel ones.

At an output a set keeps as statistics only the leans are the global ones, measured through
the statistics (``compare.lean.statistics_sums``); where its module alone had no calibration
(its inputs are statistics too) the honest range is the whole model's: the calibration pools
the members' accumulated leans at such outputs, and the range is widened by the upstream
error all the same (an implementation that rounds elsewhere upstream leans the point
differently than the members, who share their code, by at most that error).

One result per point output, request ``POOLED``; none where the calibration holds no leans
(sets captured before this numalign, a float32 borrowing its budgets), no error of the point
in the mode, or the point has too few elements to resolve one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from numalign.compare import CompareResult, Metrics
from numalign.compare.calibration import LEAN_STATISTICS, Calibrated, ControlStats
from numalign.compare.lean import Lean, LeanSums, judge_lean, lean_uses
from numalign.compare.metrics import signed_percent
from numalign.compare.model_verdict import PointResult
from numalign.compare.power import lean_detectable
from numalign.compare.statistics import STATISTICS_ONLY
from numalign.compare.tolerances import Thresholds
from numalign.core.observation import label
from numalign.core.statistics import Expected, TensorStatistics

if TYPE_CHECKING:
    import torch

#: The request name of a pooled result: every request of the replay.
POOLED = "all requests"


@dataclass
class PointLeans:
    """Pools outputs per (point, path) as a replay hands them on; ``results`` judges them
    against the isolated calibration's leans (``reduction``: the length of the reduction
    behind each output, the hidden size; ``thresholds``: the policy's, for the lean rule;
    ``mode``: the replay's, ``isolated``, ``accumulated`` or ``decode``, whose calibrated
    relative L2 error widens the range inside the model)."""

    golden: Calibrated
    dtype: str
    reduction: int = 1
    thresholds: Thresholds | None = None
    mode: str = "isolated"
    sums: dict[tuple[str, str], LeanSums] = field(default_factory=dict)
    #: when each output was first handed on (the order of the first divergence)
    first: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    #: the outputs pooled through statistics (a set's statistics-only points)
    through_statistics: set[tuple[str, str]] = field(default_factory=set)

    def add(self, point: str, path: str, actual: torch.Tensor, expected: Expected,
            order: int, finished: int) -> None:  # fmt: skip
        floating = isinstance(expected, TensorStatistics) or expected.is_floating_point()
        if not actual.is_floating_point() or not floating:
            return
        self.sums.setdefault((point, path), LeanSums()).add(actual, expected)
        self.first.setdefault((point, path), (order, finished))
        if isinstance(expected, TensorStatistics):
            self.through_statistics.add((point, path))

    def results(self) -> list[PointResult]:
        """One judged result per pooled output whose calibration holds leans (and, inside
        the model, the point's error in the mode)."""
        out = []
        for (point, path), sums in self.sums.items():
            measured = sums.finish()
            alone = self.golden.calibrated(self.dtype, point, path, "isolated")
            within = None  # the point's honest error in the model, if any
            upstream = None  # alone: no widening
            if self.mode != "isolated":
                within = self.golden.calibrated(self.dtype, point, path, self.mode)
                if within is None or within.rel_l2 is None or not math.isfinite(within.rel_l2):
                    continue
                upstream = float(within.rel_l2)
            # the leans of the module alone; where none were measured (a point kept as
            # statistics only, fed statistics), those of the whole model's (module doc)
            calibration = alone if _has_leans(alone) else within
            if measured is None or calibration is None or not _has_leans(calibration):
                continue
            order, finished = self.first[(point, path)]
            result = lean_result(label(point, path), self.dtype, measured, calibration,
                                 self.reduction, self.thresholds, upstream)  # fmt: skip
            if (point, path) in self.through_statistics:
                result = replace(
                    result,
                    reason=f"{result.reason} ({STATISTICS_ONLY}: the "
                    "global leans, through the sketch and the exact sums)",
                )
            out.append(PointResult(point, order, POOLED, path, result, self.mode,
                                   finished=finished))  # fmt: skip
        return out


def _has_leans(calibration: ControlStats | None) -> bool:
    return calibration is not None and calibration.scale_low is not None


def lean_result(
    name: str,
    dtype: str,
    measured: Lean,
    calibration: ControlStats,
    reduction: int = 1,
    thresholds: Thresholds | None = None,
    upstream: float | None = None,
) -> CompareResult:
    """The lean rule's verdict on one pooled output, as a comparison's result (rule
    ``distribution``): the honest range and the measured leans in ``budget``, the most
    significant lean beyond the range as the reason (``upstream``: ``compare.judge_lean``'s,
    in ``budget`` as ``lean_upstream`` where given)."""
    finding = judge_lean(measured, calibration, dtype, reduction, thresholds, upstream)
    uses = lean_uses(measured, calibration, dtype, reduction, thresholds, upstream)
    used = max(uses, default=0.0)
    budget = {k: float(v) for k in LEAN_STATISTICS if (v := getattr(calibration, k)) is not None}
    if upstream is not None:
        budget["lean_upstream"] = upstream
    budget |= {
        "lean_scale": measured.scale, "lean_scale_se": measured.scale_se,
        "lean_offset": measured.offset, "lean_offset_se": measured.offset_se,
        "lean_channel_scale": measured.channel_scale,
        "lean_channel_offset": measured.channel_offset, "channels": float(measured.channels),
    }  # fmt: skip
    nan = float("nan")
    result = CompareResult(
        name=name, dtype=dtype, shape=(measured.elements,), op_class="matmul", passed=True,
        rule="distribution", metrics=Metrics.blank(measured.elements, error=nan, agreement=nan),
        budget=budget, budget_used=used,
        detectable=lean_detectable(measured, calibration, dtype, reduction, thresholds, upstream),
        reason="pooled leans within the honest range: scale "
        f"{signed_percent(measured.scale, 4)}, offset {signed_percent(measured.offset, 4)} over "
        f"{measured.elements} elements",
    )  # fmt: skip
    if finding is None:
        return result
    return replace(
        result, passed=False, budget_used=max(finding.used, 1.0),
        reason=finding.reason(measured),
        hint="a systematic error below one rounding per element: check epsilon, an "
        "activation's form (exact or tanh GELU), a scale or bias applied where none belongs, "
        "and accumulation precision",
    )  # fmt: skip
