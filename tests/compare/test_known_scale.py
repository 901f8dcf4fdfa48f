"""A candidate kernel's known scale (``compare.known_scale``): the judge calls a failure
expected only where, with the measured scale taken out, every failing result passes; a
planted error on top, a failure at another point or in the logits is not explained. And the
probe's two measures (``replay.engines.vllm_kernels``) on rounding that is known."""

from __future__ import annotations

import pytest
import torch

from numalign.compare.calibration import OUTPUT_POINT, ControlStats
from numalign.compare.model_judge import ModelJudge
from numalign.compare.output_kind import TENSOR
from numalign.core.kernel_scale import KnownScale
from numalign.core.observation import Observation
from numalign.replay.engines.vllm_kernels import (
    TOWARD_ZERO_SHARE,
    least_squares_scale,
    toward_zero_share,
)

#: The honest bfloat16 ensemble: errors of a few bfloat16 roundings per element, and leans
#: within +-0.05% (the zoo's MoE blocks' ranges are +-0.04% to +-0.07%).
CONTROL = ControlStats(
    max_abs=0.03, rel_l2=0.006, cosine=1 - 2e-5, norm_ratio=1.0005, zero_fraction=0.0,
    scale_low=-5e-4, scale_high=5e-4, offset_low=-5e-4, offset_high=5e-4,
    channel_scale=3e-3, channel_offset=3e-3,
)  # fmt: skip
#: The kernel's measured scale (vLLM's CPU fused MoE rounding toward zero: 0.9942 to 0.9946).
SCALE = 0.9944
KNOWN = KnownScale(frozenset({"mlp"}), 0.9942, 0.9946, "the kernel rounds toward zero")


class _Point:
    def __init__(self, name: str, order: int) -> None:
        self.name, self.order = name, order


class Golden:
    points = (_Point("attn", 0), _Point("mlp", 1))

    def calibrated(self, dtype: str, point: str, path: str, mode: str) -> ControlStats | None:
        if point == OUTPUT_POINT:
            return ControlStats(max_abs=0.05, rel_l2=1e-2, kl_max=1e-4)
        return CONTROL

    def calibrated_paths(self, dtype: str, point: str) -> list[str]:
        return ["0"]

    def output_kind(self, point: str, path: str) -> str:
        return TENSOR


def _judge(known: KnownScale | None = KNOWN) -> ModelJudge:
    return ModelJudge(Golden(), "bfloat16", "isolated", (64, 2), known=known)


def _seen(point: str, scale: float = 1.0, request: str = "r0") -> Observation:
    expected = torch.randn(64, 64, generator=torch.Generator().manual_seed(len(request)),
                           dtype=torch.float64)  # fmt: skip
    return Observation(point, "0", request, (expected * scale).to(torch.bfloat16), expected)


def _failed(judge: ModelJudge) -> bool:
    return any(not r.result.passed for r in judge.layer_results())


def test_a_failure_that_is_the_kernels_scale_is_expected_and_names_the_evidence() -> None:
    judge = _judge()
    for request in ("r0", "r01"):
        judge.see(_seen("mlp", SCALE, request))
    assert _failed(judge)  # the pooled lean: -0.56% against the honest +-0.05%
    reason = judge.known_failure()
    assert reason is not None and reason.startswith("the kernel rounds toward zero")
    assert "(mlp)" in reason


def test_the_records_keep_their_failed_verdict() -> None:
    judge = _judge()
    judge.see(_seen("mlp", SCALE))
    results = judge.layer_results()
    assert any(not r.result.passed for r in results)
    assert judge.known_failure() is not None


def test_a_planted_scale_on_top_of_the_kernels_is_not_explained() -> None:
    judge = _judge()
    judge.see(_seen("mlp", SCALE * 1.01))  # 1% more: far beyond the kernel's range
    assert _failed(judge)
    assert judge.known_failure() is None


def test_a_failure_at_a_point_the_kernel_does_not_make_is_not_explained() -> None:
    judge = _judge()
    judge.see(_seen("mlp", SCALE))
    judge.see(_seen("attn", SCALE))
    assert judge.known_failure() is None


def test_failing_logits_are_never_the_kernels() -> None:
    judge = _judge()
    judge.see(_seen("mlp", SCALE))
    logits = torch.randn(1, 4, 32, dtype=torch.float64)
    judge.judge.judge_logits("r0", (logits + 1.0).float(), logits.float())
    assert judge.known_failure() is None


def test_nothing_failing_or_no_known_scale_expects_nothing() -> None:
    honest = _judge()
    honest.see(_seen("mlp"))
    assert not _failed(honest)
    assert honest.known_failure() is None
    unknown = _judge(known=None)
    unknown.see(_seen("mlp", SCALE))
    assert _failed(unknown) and unknown.known_failure() is None


def test_a_known_scale_needs_a_positive_range() -> None:
    with pytest.raises(ValueError, match="0 < low <= high"):
        KnownScale(frozenset({"mlp"}), 0.99, 0.98, "")


def _truncated(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 by dropping the low 16 bits (rounding toward zero)."""
    bits = x.float().contiguous().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).to(torch.bfloat16)


def test_the_probes_measures_tell_truncation_from_rounding_to_nearest() -> None:
    truth = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    nearest, toward_zero = truth.to(torch.bfloat16), _truncated(truth)
    # rounding to nearest leaves half of the magnitudes below the truth (4096 elements: a
    # standard error of 0.008), truncation all of them
    assert abs(toward_zero_share(nearest, truth) - 0.5) < 0.05
    assert toward_zero_share(toward_zero, truth) == 1.0
    assert (
        toward_zero_share(nearest, truth)
        < TOWARD_ZERO_SHARE
        <= toward_zero_share(toward_zero, truth)
    )
    # truncation to bfloat16's 8 significant bits drops half a unit of the last place on
    # average, 2**-8 of a value in [1, 2): about 0.28% of a normal sample's magnitude
    assert least_squares_scale(toward_zero, truth) < 1 - 1e-3
    assert abs(least_squares_scale(nearest, truth) - 1) < 2e-4
