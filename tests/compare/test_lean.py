"""The lean rule's statistics: pooled sums agree with one tensor's, a systematic scale or
offset far below one bfloat16 rounding is resolved from many elements, a lean confined to one
channel is found among many, and an honest rounding's lean stays within the range."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from numalign.compare.calibration import ControlStats
from numalign.compare.lean import LeanSums, judge_lean, lean, lean_uses

#: bfloat16's unit roundoff (2**-8, half its eps): the planted leans below are a quarter of
#: it, which no per-element budget at the dtype's noise can see, and twice the rule's floor
#: (an eighth, tolerances.LEAN_FLOOR_ROUNDOFFS).
BF16_ROUNDOFF = 2.0**-8


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


@pytest.fixture
def reference() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(512, 64, generator=gen, dtype=torch.float64).float()


def test_pooled_sums_equal_one_tensor_of_the_same_elements(reference: torch.Tensor) -> None:
    honest = _bf16(reference * 1.001)
    whole = lean(honest, reference)
    sums = LeanSums()
    sums.add(honest[:200], reference[:200])
    sums.add(honest[200:], reference[200:])
    pooled = sums.finish()
    assert whole is not None and pooled is not None
    # the same sums in another order: equal to float64 rounding
    assert pooled.scale == pytest.approx(whole.scale, rel=1e-9)
    assert pooled.offset == pytest.approx(whole.offset, rel=1e-9, abs=1e-12)
    assert pooled.elements == whole.elements == reference.numel()
    # the planted 0.1% scale is measured to within a few of its standard errors
    assert abs(pooled.scale - 1e-3) < 5 * pooled.scale_se


def test_a_scale_below_one_rounding_fails_and_honest_rounding_passes(
    reference: torch.Tensor,
) -> None:
    calibration = lean(_bf16(reference), reference)
    assert calibration is not None
    honest = _bf16(reference + 1e-9)  # another draw of the same rounding, as another member
    measured = lean(honest, reference)
    assert (
        measured is not None and judge_lean(measured, ControlStats.of(calibration.stats())) is None
    )
    scaled = 1.0 + BF16_ROUNDOFF / 4  # a quarter rounding: 0.098%
    planted = lean(_bf16(reference * scaled), reference)
    assert planted is not None
    finding = judge_lean(planted, ControlStats.of(calibration.stats()))
    assert finding is not None and finding.name == "scale"
    assert "systematic scale of +0.0995%" in finding.reason(planted)


def test_an_offset_is_told_from_a_scale(reference: torch.Tensor) -> None:
    calibration = lean(_bf16(reference), reference)
    assert calibration is not None
    rms = float(reference.pow(2).mean().sqrt())
    planted = lean(_bf16(reference + rms * BF16_ROUNDOFF / 4), reference)
    assert planted is not None
    finding = judge_lean(planted, ControlStats.of(calibration.stats()))
    assert finding is not None and finding.name == "offset"


def test_a_lean_in_one_channel_of_64_is_found(reference: torch.Tensor) -> None:
    calibration = lean(_bf16(reference), reference)
    assert calibration is not None
    skewed = reference.clone()
    skewed[:, 5] *= 1.01  # one channel 1% off: 1/64 of the elements, global scale 0.016%
    planted = lean(_bf16(skewed), reference)
    assert planted is not None
    finding = judge_lean(planted, ControlStats.of(calibration.stats()))
    assert finding is not None and finding.name == "channel_scale"
    assert "in one of 64 channels" in finding.reason(planted)


def test_within_the_range_and_too_few_elements_decide_nothing(reference: torch.Tensor) -> None:
    assert lean(reference[:2, :8], reference[:2, :8]) is None  # 16 elements resolve nothing
    measured = lean(_bf16(reference), reference)
    assert measured is not None
    wide = ControlStats(scale_low=-1.0, scale_high=1.0, offset_low=-1.0, offset_high=1.0)
    assert judge_lean(measured, wide) is None
    # how far each lean went towards its limit: far from it in a range of +-100%
    assert max(lean_uses(measured, wide)) < 0.01


def test_the_lean_rule_takes_the_projects_thresholds(
    reference: torch.Tensor, tmp_path: Path
) -> None:
    """``[tool.numalign.thresholds]`` reaches the lean rule: the quarter-rounding scale that
    fails at the defaults passes once the floor is raised to a whole rounding (4x the lean)."""
    from numalign.compare import load_policy

    calibration = ControlStats.of(lean(_bf16(reference), reference).stats())  # type: ignore[union-attr]
    planted = lean(_bf16(reference * (1.0 + BF16_ROUNDOFF / 4)), reference)
    assert planted is not None
    assert judge_lean(planted, calibration) is not None
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text("[tool.numalign.thresholds]\nlean_floor_roundoffs = 1.0\n")
    thresholds = load_policy(pyproject).thresholds
    assert thresholds.lean_floor_roundoffs == 1.0
    assert judge_lean(planted, calibration, thresholds=thresholds) is None
    assert max(lean_uses(planted, calibration, thresholds=thresholds)) < 1.0


def test_a_tiny_lean_prints_with_its_significant_digits() -> None:
    from numalign.compare.metrics import signed_percent

    # a float32 lean of 1.3e-8 printed with fixed decimals read "+0.000%"
    assert signed_percent(1.3e-8) == "+1.3e-06%"
    assert signed_percent(-0.00459) == "-0.459%"
