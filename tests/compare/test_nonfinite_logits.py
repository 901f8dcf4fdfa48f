"""Non-finite logits never pass the logits check: a NaN KL divergence compares False with
any budget, so ``kl_max > budget`` let it through; its use of budget is the worst."""

from __future__ import annotations

import math

import torch

from numalign.compare.core import compare
from numalign.compare.logits import logits_stats
from numalign.compare.model_verdict import LogitsResult


def test_a_nan_kl_fails_and_uses_the_whole_budget() -> None:
    golden = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    actual = golden.clone()
    actual[3] = float("nan")  # one position's logits turned NaN
    stats = logits_stats(actual, golden, near_tie=0.0)
    assert math.isnan(stats.kl_max)
    # the values are judged on a finite position (they pass): the KL rule alone is under test
    values = compare(golden[:1], golden[:1])
    assert values.passed
    verdict = LogitsResult("prompt-0", values=values, stats=stats, kl_budget=1e-3)
    assert any("KL divergence nan" in p for p in verdict.problems)
    assert verdict.kl_used == math.inf
