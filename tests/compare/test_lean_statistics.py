"""The pooled leans of an output a set keeps as statistics only (``compare.lean``:
``statistics_sums``): measured through the sketch and the exact sums, they equal the leans of
the tensor itself to far below one rounding, an honest rounding's standard errors are never
smaller than the tensor's robust ones (the rule stays as cautious where it sees fewer sums),
and a set captured without the sum of fourth powers (numalign 0.24.0) pools no lean."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from numalign.compare.lean import LeanSums, lean
from numalign.core.statistics import statistics_of

#: The default sketch width of a capture (core.statistics.DEFAULT_WIDTH).
WIDTH = 1024


def _reference() -> torch.Tensor:
    """Heavy-tailed values, as activations are (a log-normal spread of magnitudes)."""
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(48, 64, generator=gen, dtype=torch.float64)
    return base * torch.exp(torch.randn(48, 64, generator=gen, dtype=torch.float64))


def _candidates(e: torch.Tensor) -> dict[str, torch.Tensor]:
    rms = float(e.square().mean().sqrt())
    noise = torch.randn(e.shape, generator=torch.Generator().manual_seed(3), dtype=e.dtype)
    return {
        "rounded": e.bfloat16().double(),
        "scaled": (e * 1.003).bfloat16().double(),
        "offset": (e + 0.002 * rms).bfloat16().double(),
        "noisy": e + 0.004 * rms * noise,  # errors that do not scale with the values
    }


@pytest.mark.parametrize("kind", ["rounded", "scaled", "offset", "noisy"])
def test_leans_through_statistics_equal_the_tensors(kind: str) -> None:
    e = _reference()
    a = _candidates(e)[kind]
    whole = lean(a, e)
    sums = LeanSums()
    sums.add(a, statistics_of(e, WIDTH))
    through = sums.finish()
    assert whole is not None and through is not None
    assert through.elements == whole.elements == e.numel()
    # the offset is exact sums: equal to float64 rounding
    assert through.offset == pytest.approx(whole.offset, rel=1e-9, abs=1e-12)
    # the scale carries the sketch's noise in |d|^2 only: a tenth of its standard error
    assert abs(through.scale - whole.scale) < 0.1 * through.scale_se
    # an honest rounding's standard errors are never smaller than the tensor's robust ones
    # (0.95 for the offset's: its variance reads the sketch's |d|^2, one standard deviation
    # above the estimate, 4.4% at this width); where a lean is most of the error, what is
    # left of |d|^2 may read low by the sketch's noise (0.75: measured 0.83 at worst over
    # these candidates and widths 64 to 1024), which the rule's 8 standard errors absorb
    floor = 1.0 if kind == "rounded" else 0.75
    assert through.scale_se >= floor * whole.scale_se
    assert through.offset_se >= min(floor, 0.95) * whole.offset_se
    assert through.channels == 1  # global leans only: no per-channel sums are kept


def test_statistics_and_tensors_pool_into_one_global_lean() -> None:
    e = _reference()
    a = _candidates(e)["scaled"]
    sums = LeanSums()
    sums.add(a[:24], e[:24])  # a whole tensor, per channel
    sums.add(a[24:], statistics_of(e[24:], WIDTH))  # the rest through statistics
    pooled, whole = sums.finish(), lean(a, e)
    assert pooled is not None and whole is not None
    assert pooled.elements == whole.elements and pooled.channels == 1
    assert abs(pooled.scale - whole.scale) < 0.1 * pooled.scale_se


def test_a_set_without_the_fourth_powers_pools_no_lean() -> None:
    e = _reference()
    sums = LeanSums()
    sums.add(e.bfloat16().double(), replace(statistics_of(e, WIDTH), fourth=None))
    assert sums.finish() is None


def test_a_shape_that_differs_pools_nothing() -> None:
    e = _reference()
    sums = LeanSums()
    sums.add(e[:, :32], statistics_of(e, WIDTH))
    assert sums.finish() is None
