"""How two sets of logits agree: top-1 and top-5 agreement with near-tie allowances, KL
divergence and max abs error, over the positions kept. Plain statistics; the model verdict
(``numalign.compare.model_verdict``) judges them against the calibration."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from numalign.compare.tolerances import Thresholds

if TYPE_CHECKING:
    import torch

#: The top-N set compared (top-5 overlap).
TOP_N = 5


@dataclass(frozen=True)
class LogitsStats:
    """Agreement of ``actual`` logits with ``expected`` ones over ``positions`` positions.

    ``top1_unexplained`` counts positions whose top-1 tokens differ although the expected
    logits of the two tokens differ by more than ``near_tie`` (a gap that errors within the
    budget cannot close); ``top5_unexplained`` likewise for expected top-N tokens pushed out of
    the actual top-N. ``kl_max`` is the largest KL(expected || actual) over positions, in nats.
    """

    positions: int
    top1_agreement: float
    top1_unexplained: int
    top5_overlap: float
    top5_unexplained: int
    kl_max: float
    max_abs: float
    near_tie: float

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def logits_stats(actual: torch.Tensor, expected: torch.Tensor, near_tie: float) -> LogitsStats:
    """Statistics of ``actual`` against ``expected``, both [positions, vocab] (padding already
    removed). Differences among tokens whose expected logits lie within ``near_tie`` of each
    other are explained: each of two logits may move by half of it."""
    import torch

    a, e = actual.double().cpu(), expected.double().cpu()
    if a.numel() == 0:
        return LogitsStats(0, 1.0, 0, 1.0, 0, 0.0, 0.0, near_tie)
    top1_a, top1_e = a.argmax(-1), e.argmax(-1)
    agree = top1_a == top1_e
    gap = e.gather(-1, top1_e[:, None])[:, 0] - e.gather(-1, top1_a[:, None])[:, 0]
    top1_unexplained = int((~agree & (gap > near_tie)).sum())
    n = min(TOP_N, a.shape[-1])
    top_a, top_e = a.topk(n, -1).indices, e.topk(n, -1).indices
    in_actual = (top_e[:, :, None] == top_a[:, None, :]).any(-1)  # [positions, n]
    # an expected top-N token pushed out is explained when an intruder's expected logit is
    # within near_tie of it
    intruders = ~(top_a[:, :, None] == top_e[:, None, :]).any(-1)
    intruder_logit = torch.where(
        intruders, e.gather(-1, top_a), torch.full_like(e[:, :n], -torch.inf)
    )
    lowest_needed = e.gather(-1, top_e) - near_tie
    pushed_out = ~in_actual & (intruder_logit.max(-1, keepdim=True).values < lowest_needed)
    kl = torch.nn.functional.kl_div(
        a.log_softmax(-1), e.log_softmax(-1), log_target=True, reduction="none"
    ).sum(-1)
    return LogitsStats(
        positions=int(a.shape[0]),
        top1_agreement=float(agree.double().mean()),
        top1_unexplained=top1_unexplained,
        top5_overlap=float(in_actual.double().mean()),
        top5_unexplained=int(pushed_out.any(-1).sum()),
        kl_max=float(kl.max()),
        max_abs=float((a - e).abs().max()),
        near_tie=near_tie,
    )


def near_tie(max_abs_budget: float, thresholds: Thresholds | None = None) -> float:
    """How far apart two tokens' golden logits may lie for a top-1 or top-5 difference (or
    the greedy continuation's first differing token) to be a near tie: each of the two may
    move by the logits' max-abs budget (``tolerances.NEAR_TIE_MULTIPLIER``)."""
    return (thresholds or Thresholds()).near_tie_multiplier * max_abs_budget


def kl_budget(
    spread: float,
    control_kl: float,
    ulp: float,
    vocab: int,
    thresholds: Thresholds | None = None,
) -> float:
    """The logits' KL budget: the control's KL times the relative L2 spread squared, plus
    two roundings of every logit (``ulp`` at the largest golden logit) and the KL's own
    float64 evaluation over ``vocab`` tokens (``tolerances.KL_*``)."""
    t = thresholds or Thresholds()
    evaluation = t.kl_evaluation_roundoff * (math.log(max(vocab, 1)) + 1.0)
    return (
        math.pow(spread, t.kl_spread_power) * control_kl + t.kl_rounding_floor * ulp**2 + evaluation
    )
