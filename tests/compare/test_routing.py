"""A router's outputs as numalign keeps and judges them (``golden.routing``,
``compare.routing``): the weight each expert gets per token, judged on the tokens whose
chosen experts agree, and the tokens that choose otherwise counted against the honest
ensemble's."""

from __future__ import annotations

import math

import pytest
import torch

from numalign.compare import ControlErrors
from numalign.compare.calibration import Control, ControlStats, control_for
from numalign.compare.model_verdict import compare_point
from numalign.compare.output_kind import ROUTING_KIND
from numalign.compare.routing import ROUTING, allowed_flips
from numalign.compare.tolerances import Thresholds
from numalign.golden.routing import point_tensors
from numalign.replay.calibrate import _stats
from numalign.replay.layer import kept_positions

TOKENS, EXPERTS, K = 256, 8, 2
LABEL = f"model.layers.1.mlp.gate.{ROUTING}"


def router(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A softmax top-2 router's (logits, weights, indices) on random tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(TOKENS, EXPERTS, generator=g)
    weights, indices = logits.softmax(-1).topk(K, dim=-1)
    return logits, weights / weights.sum(-1, keepdim=True), indices


def routing(weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    logits = torch.zeros(weights.shape[0], EXPERTS)
    return dict(point_tensors((logits, weights, indices)))[ROUTING]


def choose_other(indices: torch.Tensor, rows: int) -> torch.Tensor:
    """``indices`` with the first ``rows`` tokens' second expert replaced by the first expert
    they did not choose."""
    other = indices.clone()
    for row in range(rows):
        other[row, 1] = next(e for e in range(EXPERTS) if e not in indices[row].tolist())
    return other


def control(max_abs: float, flips: float | None) -> Control:
    return Control(ControlErrors(max_abs=max_abs, rel_l2=max_abs), reduction=64, flips=flips)


def test_a_router_is_kept_as_its_logits_and_the_weight_of_each_expert() -> None:
    logits, weights, indices = router()
    paths = point_tensors((logits, weights, indices))
    assert [p for p, _ in paths] == ["0", ROUTING]
    dense = paths[1][1]
    assert dense.shape == (TOKENS, EXPERTS)
    assert torch.equal(dense.gather(-1, indices), weights)  # each chosen expert's weight
    assert int((dense != 0).sum()) == TOKENS * K  # zero for the others
    # the slots' order is the kernel's (DeepSeek-V3: topk(sorted=False)): no part of it
    assert torch.equal(routing(weights.flip(-1), indices.flip(-1)), dense)


def test_other_outputs_are_kept_as_they_are() -> None:
    hidden, attention = torch.randn(1, 4, 8), torch.rand(1, 2, 4, 4)
    assert [p for p, _ in point_tensors((hidden, attention))] == ["0", "1"]
    # three tensors that are no router's (no integer indices of the weights' shape)
    three = (torch.randn(4, 8), torch.randn(4, 2), torch.randn(4, 2))
    assert [p for p, _ in point_tensors(three)] == ["0", "1", "2"]


def test_a_router_equal_to_the_golden_one_passes() -> None:
    _, weights, indices = router()
    dense = routing(weights, indices)
    result = compare_point(dense.clone(), dense, LABEL, control(1e-4, 0.0), None, ROUTING_KIND)
    assert result.passed, result.message()


def test_a_bias_in_the_weights_fails_on_the_tokens_that_choose_alike() -> None:
    _, weights, indices = router()
    golden = routing(weights, indices)
    # DeepSeek-V3's bug: each weight moved by a per-expert bias of a few percent of it,
    # against a control that errs by 1e-3 (an honest bfloat16 router errs by 5e-4)
    bias = 0.02 * torch.randn(EXPERTS, generator=torch.Generator().manual_seed(1))
    biased = weights + bias[indices]
    result = compare_point(
        routing(biased, indices), golden, LABEL, control(1e-3, 0.0), None, ROUTING_KIND
    )
    assert not result.passed and result.rule == "budget", result.message()


def test_flips_within_the_ensembles_pass_and_the_weights_are_judged_without_them() -> None:
    _, weights, indices = router()
    golden = routing(weights, indices)
    actual = routing(weights, choose_other(indices, 3))  # three tokens choose anew
    assert int(((actual != 0) != (golden != 0)).any(-1).sum()) == 3
    # the ensemble flipped 3 of 256 too: a whole weight moved on each, yet within budget
    result = compare_point(actual, golden, LABEL, control(1e-6, 3 / TOKENS), None, ROUTING_KIND)
    assert result.passed, result.message()
    assert result.budget["flips"] == 3 and result.shape == (TOKENS - 3, EXPERTS)


def test_more_flips_than_the_ensembles_fail_as_a_selection() -> None:
    _, weights, indices = router()
    golden = routing(weights, indices)
    # every token chooses another second expert (a choice by other scores)
    other = choose_other(indices, TOKENS)
    result = compare_point(routing(weights, other), golden, LABEL, control(1e-3, 3 / TOKENS),
                           None, ROUTING_KIND)  # fmt: skip
    assert not result.passed and result.rule == "ties", result.message()
    assert "choose other experts" in result.reason
    # its likely cause says so: a routing change, not the weights' signature
    assert result.cause is not None and result.cause.label == "routing"
    assert "Likely cause: routing" in result.message()


def test_the_allowance_is_a_poisson_bound_on_the_ensembles_fraction() -> None:
    t = Thresholds()
    # none seen: flip_z flips (a tie the members did not meet)
    assert allowed_flips(None, 480, t) == pytest.approx(t.flip_z)
    # 3 of 480 seen: 3 more than that plus flip_z standard deviations of a mean of 3 (+1)
    assert allowed_flips(3 / 480, 480, t) == pytest.approx(3 + t.flip_z * math.sqrt(4))


def test_the_calibration_keeps_the_flips_and_the_agreeing_tokens_errors() -> None:
    _, weights, indices = router()
    golden = routing(weights, indices)
    actual = routing(weights * (1 + 1e-3), choose_other(indices, 1))
    stats = _stats(actual, golden, ROUTING_KIND)
    assert stats["flips"] == pytest.approx(1 / TOKENS)
    # the errors are the agreeing tokens': a 0.1% scale, not a whole weight
    assert stats["max_abs"] == pytest.approx(1e-3 * float(weights.max()), rel=1e-3)


def test_a_control_carries_the_flips_and_a_finer_dtype_borrows_them_scaled() -> None:
    class Golden:
        def calibrated(self, dtype: str, point: str, path: str, mode: str) -> ControlStats | None:
            if dtype != "bfloat16":
                return None
            return ControlStats(max_abs=5e-4, rel_l2=1e-4, flips=0.01)

        def calibrated_paths(self, dtype: str, point: str) -> list[str]:
            return [ROUTING] if dtype == "bfloat16" else []

    own = control_for(Golden(), "bfloat16", "gate", ROUTING, "isolated", hidden=64, depth=2)
    assert own.flips == 0.01
    finer = control_for(Golden(), "float32", "gate", ROUTING, "isolated", hidden=64, depth=2)
    # float32 borrows bfloat16's scaled by the ratio of roundoffs times sqrt(hidden)
    scale = 2.0**-16 * 8
    assert finer.flips == pytest.approx(0.01 * scale)


def test_padding_tokens_of_a_flattened_output_are_not_compared() -> None:
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # a left-padded request of two rows
    rows = torch.arange(6.0)[:, None].expand(6, EXPERTS)  # [batch * seq, experts]
    kept = kept_positions(rows, mask)
    assert kept[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
