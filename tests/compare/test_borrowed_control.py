"""A finer dtype's control borrowed from a 16-bit calibration (``compare.calibration``)."""

from __future__ import annotations

import math

import pytest

from numalign.compare.calibration import ControlStats, control_for

HIDDEN = 64
#: float16 -> float32: the ratio of unit roundoffs (2**-10 / 2**-23) times the reduction's
#: walk sqrt(hidden)
SCALE = 2.0**-13 * math.sqrt(HIDDEN)


class Golden:
    """A calibration of one attention point: its output "0" in float16 and float32, its
    weights "1" in float16 alone (the float32 members run SDPA, which returns no weights)."""

    def __init__(self, own_float32: float) -> None:
        self.table = {
            ("float16", "0"): ControlStats(max_abs=1e-2, rel_l2=1e-3),
            ("float16", "1"): ControlStats(max_abs=4e-3, rel_l2=2e-3),
            ("float32", "0"): ControlStats(max_abs=own_float32 * 1e-2 * SCALE, rel_l2=1e-3 * SCALE),
        }

    def calibrated(self, dtype: str, point: str, path: str, mode: str) -> ControlStats | None:
        return self.table.get((dtype, path))

    def calibrated_paths(self, dtype: str, point: str) -> list[str]:
        return [path for (table, path) in self.table if table == dtype]


def test_an_output_calibrated_in_its_dtype_is_judged_by_the_worse_of_its_own_and_borrowed() -> None:
    control = control_for(Golden(1.5), "float32", "attn", "0", "accumulated", HIDDEN, 2)
    assert control.errors.max_abs == pytest.approx(1.5e-2 * SCALE)
    assert control.errors.rel_l2 == pytest.approx(1e-3 * SCALE)


def test_an_output_its_dtype_cannot_measure_borrows_raised_by_its_siblings_excess() -> None:
    """The weights borrow float16's, raised by how far output 0's own float32 calibration
    exceeds output 0's borrowed estimate (1.5x in max abs)."""
    control = control_for(Golden(1.5), "float32", "attn", "1", "accumulated", HIDDEN, 2)
    assert control.errors.max_abs == pytest.approx(4e-3 * SCALE * 1.5)
    assert control.errors.rel_l2 == pytest.approx(2e-3 * SCALE * 1.5)


def test_a_sibling_within_its_borrowed_estimate_never_lowers_the_borrowed_control() -> None:
    control = control_for(Golden(0.25), "float32", "attn", "1", "accumulated", HIDDEN, 2)
    assert control.errors.max_abs == pytest.approx(4e-3 * SCALE)


def test_a_sixteen_bit_dtype_never_borrows() -> None:
    control = control_for(Golden(1.5), "float16", "attn", "1", "accumulated", HIDDEN, 2)
    assert control.errors.max_abs == pytest.approx(4e-3)
