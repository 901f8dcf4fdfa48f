"""The distribution rule of model replay and chance zeros: a sum rounded to bfloat16 lands
exactly on zero where the true value is below one rounding of its addends (a residual add,
a row-parallel all-reduce, a compiled kernel's fused sum). Zeros where the reference lies
within one ulp of the output's largest magnitude pass; zeros where it is clearly non-zero at
the output's scale (a zeroed tile or row) still fail, within the value budget or not."""

from __future__ import annotations

import torch

from numalign.compare import ControlErrors
from numalign.replay.model import Control, cancellation_zeros, compare_point

#: 128 values at the scale of a hidden state: largest 3.0, so one bfloat16 ulp there is
#: 2**(1 - 7) = 0.0156; positions 10 and 20 hold values below it, 30 to 33 values above it.
EXPECTED = torch.linspace(-3.0, 3.0, 128)
EXPECTED[10], EXPECTED[20] = 0.004, -0.012
EXPECTED[30:34] = torch.tensor([0.05, -0.06, 0.07, -0.08])
#: A budget wide enough for every zero below (0.08 is within 0.2): only the distribution rule
#: can tell them apart.
CONTROL = Control(ControlErrors(max_abs=0.05, rel_l2=0.01), reduction=64)


def test_zeros_within_a_rounding_of_the_output_scale_are_expected() -> None:
    errors = cancellation_zeros(CONTROL.errors, EXPECTED, "bfloat16")
    # 0.004 and -0.012, and none of the others (the grid's step is 6/127 = 0.047)
    assert errors.zero_fraction == 2 / 128
    actual = EXPECTED.to(torch.bfloat16)
    actual[10] = actual[20] = 0.0
    assert compare_point(actual, EXPECTED, "p", CONTROL, None).passed


def test_a_zeroed_run_of_values_at_the_output_scale_still_fails() -> None:
    actual = EXPECTED.to(torch.bfloat16)
    actual[30:34] = 0.0
    result = compare_point(actual, EXPECTED, "p", CONTROL, None)
    assert not result.passed and result.rule == "distribution"


def test_float32_expects_no_more_zeros_than_its_control() -> None:
    # one float32 ulp at 3.0 is 2**-22: no value of the grid is that close to zero
    assert cancellation_zeros(CONTROL.errors, EXPECTED, "float32") is CONTROL.errors
