"""The lean rule of layer replay: a capture point's outputs replayed alone, pooled over every
request and call, and their leans (``compare.lean``) judged against the range the set's
isolated calibration reached in the same dtype. A pooled lean resolves a systematic error far
below one rounding per element (a norm 0.3% too large in bfloat16), which the
per-comparison budgets, at the dtype's noise, let through.

One result per point output, request ``POOLED``; none where the calibration holds no leans
(sets captured before this numalign, a float32 borrowing its budgets) or the point has too few
elements to resolve one. Leans are not judged inside the whole model (``compare.lean``: honest
upstream noise leans the outputs there).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from numalign.compare import CompareResult, Metrics
from numalign.compare.calibration import LEAN_STATISTICS, ControlStats
from numalign.compare.lean import Lean, LeanSums, judge_lean, lean_uses
from numalign.compare.model_verdict import PointResult, label
from numalign.compare.tolerances import Thresholds

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet

#: The request name of a pooled result: every request of the replay.
POOLED = "all requests"


@dataclass
class PointLeans:
    """Pools outputs per (point, path) as a layer replay hands them on; ``results`` judges
    them against the isolated calibration (``reduction``: the length of the reduction behind
    each output, the hidden size; ``thresholds``: the policy's, for the lean rule)."""

    golden: GoldenSet
    dtype: str
    reduction: int = 1
    thresholds: Thresholds | None = None
    sums: dict[tuple[str, str], LeanSums] = field(default_factory=dict)
    #: when each output was first handed on (the order of the first divergence)
    first: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)

    def add(self, point: str, path: str, actual: torch.Tensor, expected: torch.Tensor,
            order: int, finished: int) -> None:  # fmt: skip
        if not actual.is_floating_point() or not expected.is_floating_point():
            return
        self.sums.setdefault((point, path), LeanSums()).add(actual, expected)
        self.first.setdefault((point, path), (order, finished))

    def results(self) -> list[PointResult]:
        """One judged result per pooled output whose calibration holds leans."""
        out = []
        for (point, path), sums in self.sums.items():
            calibration = self.golden.calibrated(self.dtype, point, path, "isolated")
            measured = sums.finish()
            if calibration is None or measured is None or calibration.scale_low is None:
                continue
            order, finished = self.first[(point, path)]
            result = lean_result(label(point, path), self.dtype, measured, calibration,
                                 self.reduction, self.thresholds)  # fmt: skip
            out.append(PointResult(point, order, POOLED, path, result, "isolated",
                                   finished=finished))  # fmt: skip
        return out


def lean_result(
    name: str,
    dtype: str,
    measured: Lean,
    calibration: ControlStats,
    reduction: int = 1,
    thresholds: Thresholds | None = None,
) -> CompareResult:
    """The lean rule's verdict on one pooled output, as a comparison's result (rule
    ``distribution``): the honest range and the measured leans in ``budget``, the most
    significant lean beyond the range as the reason."""
    finding = judge_lean(measured, calibration, dtype, reduction, thresholds)
    used = max(lean_uses(measured, calibration, dtype, reduction, thresholds), default=0.0)
    budget = {k: float(v) for k in LEAN_STATISTICS if (v := getattr(calibration, k)) is not None}
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
        reason=f"pooled leans within the honest range: scale {measured.scale:+.4%}, offset "
        f"{measured.offset:+.4%} over {measured.elements} elements",
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
