"""The lean rule inside the whole model (``compare.lean``): the honest range is widened both
ways by the point's calibrated relative L2 error in the mode (``upstream``), the margin beyond
it stays the members' own, and per-channel leans are not judged there. The planted LayerNorm
of the unbiased variance that this catches in the whole model is
``tests/replay/test_planted_inputs.py``'s."""

from __future__ import annotations

import pytest
import torch

from numalign.compare.calibration import ControlStats
from numalign.compare.lean import judge_lean, lean, lean_uses

#: bfloat16's unit roundoff (2**-8, half its eps).
BF16_ROUNDOFF = 2.0**-8


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


@pytest.fixture
def reference() -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    return torch.randn(512, 64, generator=gen, dtype=torch.float64).float()


def test_the_upstream_error_widens_the_range_both_ways(reference: torch.Tensor) -> None:
    calibration = lean(_bf16(reference), reference)
    assert calibration is not None
    honest = ControlStats.of(calibration.stats())
    # a scale of 0.5% (1.3 roundings): alone it fails, far beyond the members' range
    planted = lean(_bf16(reference * 1.005), reference)
    assert planted is not None
    assert judge_lean(planted, honest, "bfloat16") is not None
    # inside a model whose honest error is 1% relative L2, an error that size may lean its
    # output by up to 1% (Cauchy-Schwarz): 0.5% is within, either way
    assert judge_lean(planted, honest, "bfloat16", upstream=0.01) is None
    shrunk = lean(_bf16(reference * 0.995), reference)
    assert shrunk is not None
    assert judge_lean(shrunk, honest, "bfloat16", upstream=0.01) is None
    # where the honest error upstream is 0.1%, the 0.5% scale still fails, and says by what
    # the range was widened
    finding = judge_lean(planted, honest, "bfloat16", upstream=0.001)
    assert finding is not None and finding.name == "scale"
    assert "widened by ±0.1% for the honest error upstream" in finding.reason(planted)


def test_the_widening_does_not_widen_the_spread_term(reference: torch.Tensor) -> None:
    # the margin beyond the widened range is LEAN_Z standard errors, the members' own width
    # and the floor: a range widened by u must not add 2u of spread, or a lean twice the
    # allowance would pass. Members that lean exactly 0 (width 0): a lean of 3u with u = 0.5%
    # lies 1% beyond the range, far more than its margin (8 standard errors of 512 x 64
    # elements, about 1e-4, and the floor's 0.05%)
    exact = ControlStats(scale_low=0.0, scale_high=0.0, offset_low=0.0, offset_high=0.0)
    planted = lean(_bf16(reference * 1.015), reference)
    assert planted is not None
    finding = judge_lean(planted, exact, "bfloat16", upstream=0.005)
    assert finding is not None and finding.used > 1.5, finding


def test_per_channel_leans_are_judged_alone_only(reference: torch.Tensor) -> None:
    calibration = lean(_bf16(reference), reference)
    assert calibration is not None
    skewed = reference.clone()
    skewed[:, 5] *= 1.01  # one channel 1% off: alone a channel lean, caught
    planted = lean(_bf16(skewed), reference)
    assert planted is not None
    honest = ControlStats.of(calibration.stats())
    alone = judge_lean(planted, honest)
    assert alone is not None and alone.name == "channel_scale"
    # inside the model a channel's errors share their upstream: only the global leans count
    # (two of them: scale and offset), and the global scale of 0.016% is far within a 0.3%
    # allowance
    uses = lean_uses(planted, honest, upstream=0.003)
    assert len(uses) == 2 and max(uses) == 0.0, uses
