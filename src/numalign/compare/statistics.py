"""A point output the golden set keeps as statistics only, judged by them
(``core.statistics``: exact norm, sum, largest magnitude and non-finite counts, and a
sketch of the tensor).

The rules are the calibrated ones, measured through the statistics, in the usual order:

- shape: the candidate's shape at the kept positions against the one recorded;
- non-finite: a NaN or infinity beyond the golden tensor's counts fails (their positions are
  not kept: counts are what can be compared);
- budget: the relative L2 error, estimated from the sketches (the candidate's sketch minus
  the golden one is the sketch of its error), against the calibrated control's relative L2
  budget (``measure.control_budget``: multiplier times the control's, plus eps and the
  accumulation allowance), widened by the estimate's own margin
  (``core.statistics.estimate_margin``: three standard deviations, 6.6% at the default
  width) so that the sketch's noise never fails an honest candidate. The max-abs part of the
  budget is not judged: one element's error is not in the statistics;
- distribution: the exact norm ratio and the cosine (from the exact norms and the estimated
  error) within the calibrated control's limits (``distribution.calibrated_limits``).

The calibration measured its members the same way at these points (``replay.calibrate``), so
a budget and the error it bounds are alike. What is not judged: the max-abs budget, exact
zeros and the cause of a failure, all of which need elements; the power (``Detectable``) is
read from the relative L2 and norm limits. The pooled leans are judged through the
statistics (``compare.lean.statistics_sums``, ``compare.pooled``), global ones only. Every
result says "judged on statistics only" in its reason.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from numalign.compare.budgets import Decision
from numalign.compare.distribution import calibrated_limits
from numalign.compare.measure import control_budget
from numalign.compare.metrics import Metrics
from numalign.compare.policy import DEFAULT_POLICY
from numalign.compare.power import Detectable
from numalign.compare.result import CompareResult
from numalign.core.dtypes import dtype_name
from numalign.core.statistics import TensorStatistics, distance, estimate_margin

if TYPE_CHECKING:
    import torch

    from numalign.compare.calibration import Control

#: Said in every statistics-only result's reason.
STATISTICS_ONLY = "judged on statistics only"


def statistics_metrics(actual: torch.Tensor, golden: TensorStatistics) -> Metrics:
    """What can be measured of ``actual`` against a tensor kept as ``golden`` statistics:
    the relative L2 error (estimated from the sketches), the cosine (from the exact norms and
    the estimated error), the exact norm ratio and the non-finite counts; every other error
    metric NaN."""
    import torch

    flat = actual.detach().reshape(-1).to("cpu", torch.float64)
    finite = flat.isfinite()
    norm = float(torch.where(finite, flat, torch.zeros((), dtype=torch.float64)).norm())
    error = distance(actual, golden)
    ref = golden.norm
    rel = error / ref if ref > 0 else (0.0 if error == 0 else math.inf)
    cosine = 1.0
    if norm > 0 and ref > 0:  # |a - e|^2 = |a|^2 + |e|^2 - 2 a.e
        cosine = max(-1.0, min(1.0, (norm * norm + ref * ref - error * error) / (2 * norm * ref)))
    nan = math.nan
    return Metrics.blank(
        flat.numel(), error=nan, agreement=nan, rel_l2=rel, cosine=cosine,
        norm_ratio=norm / ref if ref > 0 else (1.0 if norm == 0 else math.inf),
        nan_actual=int(flat.isnan().sum()), inf_actual=int(flat.isinf().sum()),
        nan_expected=golden.nan, inf_expected=golden.posinf + golden.neginf,
        max_expected=golden.absmax,
    )  # fmt: skip


def judge_statistics(
    actual: torch.Tensor, golden: TensorStatistics, name: str, control: Control, policy: Any
) -> CompareResult:
    """``actual`` against the statistics ``golden`` within ``control`` (the module doc)."""
    dtype = dtype_name(actual.dtype)
    shape = tuple(actual.shape)
    metrics = (
        statistics_metrics(actual, golden)
        if shape == golden.shape
        else Metrics.blank(actual.numel(), error=math.nan, agreement=math.nan)
    )
    control_metrics = control.errors.as_statistics(golden.numel, golden.absmax)
    budget = control_budget(dtype, control_metrics, None, control.reduction, name,
                            policy or DEFAULT_POLICY, None, "calibration")  # fmt: skip
    margin = estimate_margin(golden.width)
    limits = calibrated_limits(control_metrics, budget.rel_l2_multiplier, dtype, budget,
                               control.propagated)  # fmt: skip
    rel_limit = budget.rel_l2 * (1 + margin)
    limits_dict = {
        "rel_l2": rel_limit, "rel_l2_multiplier": budget.rel_l2_multiplier,
        "control_rel_l2": budget.control_rel_l2, "eps": budget.eps,
        "accumulation_rel": budget.accumulation_rel, "estimate_margin": margin,
        "norm": limits.norm or 0.0, "cosine": limits.cosine or 0.0,
        "sketch_width": float(golden.width),
    }  # fmt: skip
    decision = _decide(metrics, shape, golden, rel_limit, limits.norm or 0.0,
                       limits.cosine or 0.0)  # fmt: skip
    used = decision.used
    if not decision.passed and math.isfinite(used):
        used = max(used, 1.0)
    detectable = None
    if shape == golden.shape and math.isfinite(metrics.rel_l2):
        # a scale s moves the norm ratio by s (caught past the norm limit, the worse sign
        # first) and adds an error of s to the relative L2's (caught past its limit); a
        # bias of b RMS adds b to it; errors of other kinds add as if orthogonal
        room = math.sqrt(max(rel_limit**2 - metrics.rel_l2**2, 0.0))
        norm_room = (limits.norm or 0.0) + abs(metrics.norm_ratio - 1)
        detectable = Detectable(scale=min(norm_room, room), bias=room)
    return CompareResult(
        name=name, dtype=dtype, shape=shape, op_class="matmul", passed=decision.passed,
        rule=decision.rule, reason=f"{decision.reason} ({STATISTICS_ONLY}: {golden.width} "
        f"sketch buckets, the relative L2 error estimated within {margin:.1%})",
        metrics=metrics, control=control_metrics, budget=limits_dict, budget_used=used,
        hint=None if decision.passed else decision.hint, detectable=detectable,
    )  # fmt: skip


def _decide(
    m: Metrics,
    shape: tuple[int, ...],
    golden: TensorStatistics,
    rel_limit: float,
    norm_limit: float,
    cosine_limit: float,
) -> Decision:
    """The first rule that fails, else a pass with the most of its budget any used."""
    if shape != golden.shape:
        return Decision("shape", False, f"shape {list(shape)} where the golden tensor's is "
                        f"{list(golden.shape)}", "check the layout and the positions kept",
                        used=math.inf)  # fmt: skip
    extra = m.nan_actual + m.inf_actual - golden.nonfinite
    if extra > 0:
        return Decision("non-finite", False, f"{m.nan_actual} NaN and {m.inf_actual} Inf where "
                        f"the golden tensor has {golden.nonfinite} values that are not finite",
                        "check overflow and division by zero", used=math.inf)  # fmt: skip
    rel_used = m.rel_l2 / rel_limit if rel_limit > 0 else (0.0 if m.rel_l2 == 0 else math.inf)
    if rel_used > 1:
        return Decision("budget", False, f"the relative L2 error is about {m.rel_l2:.3g}, over "
                        f"the budget's {rel_limit:.3g}", "a module whose outputs differ beyond "
                        "honest rounding: replay it alone, or capture it whole (--full-points) "
                        "to see where", used=rel_used)  # fmt: skip
    norm_used = abs(m.norm_ratio - 1) / norm_limit if norm_limit > 0 else 0.0
    cos_used = (1 - m.cosine) / cosine_limit if cosine_limit > 0 else 0.0
    if norm_used > 1:
        return Decision("distribution", False, f"the norm ratio is {m.norm_ratio:.6g}, off by "
                        f"more than {norm_limit:.3g}", "a systematic scale error: check epsilon, "
                        "a missing or doubled scale", used=norm_used)  # fmt: skip
    if cos_used > 1:
        return Decision("distribution", False, f"the cosine similarity is about {m.cosine:.8g}, "
                        f"below 1 - {cosine_limit:.3g}", "the output's direction differs: check "
                        "permuted channels, heads or positions", used=cos_used)  # fmt: skip
    return Decision("budget", True, f"within the calibrated budget: relative L2 about "
                    f"{m.rel_l2:.3g}, norm ratio {m.norm_ratio:.6g}",
                    used=max(rel_used, norm_used, cos_used))  # fmt: skip
