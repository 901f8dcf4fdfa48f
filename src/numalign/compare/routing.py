"""The routing verdict: a router's combine weights per expert (``golden.routing``) against the
golden ones.

A router chooses k experts per token and weighs them. Where two experts nearly tie, an honest
run in a lower precision may choose the other one (its rounding moves the scores across the
tie), and every honest member of the calibration shares the golden input's rounding, so
the ensemble flips the same few tokens a candidate does. A flipped token moves a whole
weight from one expert to another; judged with the rest, it would swamp any budget and hide
what a port gets wrong in the weights themselves (DeepSeek-V3's correction bias added into
them: about 4% of a weight, against bfloat16's 0.1%). So the routing is judged in two parts:

- the tokens whose chosen experts agree (``agreeing``), by their weights per expert, against
  the calibrated budget of the same tokens of the honest members (rule budget, as any
  point's output); the slots' order is no part of it (DeepSeek-V3 chooses with
  ``topk(sorted=False)``);
- the tokens whose chosen experts differ (flips), by their count against the ensemble's
  (``allowed_flips``): rule ``ties``, as a selection that may differ only among near ties.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from numalign.compare.cause import ROUTING_CONFIDENCE, Cause
from numalign.compare.result import CompareResult
from numalign.compare.tolerances import Thresholds

if TYPE_CHECKING:
    import torch

#: The output path of a router's combine weights per expert ([tokens, experts], zero where an
#: expert is not chosen).
ROUTING = "routing"


def agreeing(
    actual: torch.Tensor, expected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The rows (tokens) of two routings of one shape whose chosen experts agree, as
    [rows, experts] of each, then the count of rows that choose differently and of all rows."""
    experts = expected.shape[-1] if expected.dim() else 1
    a, e = actual.reshape(-1, experts), expected.reshape(-1, experts)
    same = ((a != 0) == (e != 0)).all(-1)
    return a[same], e[same], int((~same).sum()), int(same.numel())


def allowed_flips(fraction: float | None, tokens: int, thresholds: Thresholds) -> float:
    """How many of ``tokens`` may choose other experts than the reference's: the honest
    ensemble's worst fraction (``fraction``; none calibrated: zero) of them, plus
    ``thresholds.flip_z`` standard deviations of a Poisson count of that mean, with one
    flip more in its variance, so that a calibration that saw none still allows a tie its
    members did not meet."""
    mean = (fraction or 0.0) * tokens
    return mean + thresholds.flip_z * math.sqrt(mean + 1.0)


def judge_flips(
    result: CompareResult,
    flips: int,
    tokens: int,
    fraction: float | None,
    thresholds: Thresholds,
) -> CompareResult:
    """``result`` (the agreeing tokens' weights) with the flips' count judged: failed (rule
    ``ties``) where more tokens choose other experts than ``allowed_flips``."""
    allowed = allowed_flips(fraction, tokens, thresholds)
    used = flips / allowed if allowed > 0 else (math.inf if flips else 0.0)
    budget = dict(result.budget) | {"flips": float(flips), "flips_allowed": allowed}
    if flips <= allowed:
        return replace(result, budget=budget)
    honest = f"{fraction:.3g}" if fraction else "none"
    why = (
        f"{flips} of {tokens} tokens choose other experts than the reference (honest runs: "
        f"{honest} of their tokens; at most {allowed:.1f} allowed here)"
    )
    if not result.passed:  # the weights failed first: their reason leads
        return replace(result, budget=budget, budget_used=max(result.budget_used, used),
                       reason=f"{result.reason}; and {why}")  # fmt: skip
    return replace(
        result, passed=False, rule="ties", budget=budget,
        budget_used=max(result.budget_used, used), reason=why,
        cause=Cause("routing", f"the chosen experts differ: {why}", ROUTING_CONFIDENCE),
        hint=(
            "the router chooses differently, not only at near ties: check the scores it "
            "chooses by (a bias, a softmax or sigmoid in the wrong dtype or place), k and "
            "group limits"
        ),
    )  # fmt: skip
