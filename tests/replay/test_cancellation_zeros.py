"""The distribution rule of model replay and chance zeros: a sum rounded to bfloat16 lands
exactly on zero where the honest value before rounding (the reference plus its honest error)
is below one rounding of its addends (a residual add, a row-parallel all-reduce, a compiled
kernel's fused sum). Zeros where the reference lies within the control's worst error plus one
ulp of the output's largest magnitude pass; zeros beyond what the honest error explains (a
zeroed tile or row) still fail, within the value budget or not."""

from __future__ import annotations

import torch

from numalign.compare import ControlErrors
from numalign.compare.calibration import Control
from numalign.compare.model_verdict import chance_zero_reach, compare_point

#: 128 values at the scale of a hidden state: largest 3.0, so one bfloat16 ulp there is
#: 2**(1 - 7) = 0.0156; positions 10 and 20 hold values below it, 30 to 33 values above it.
EXPECTED = torch.linspace(-3.0, 3.0, 128)
EXPECTED[10], EXPECTED[20] = 0.004, -0.012
EXPECTED[30:34] = torch.tensor([0.05, -0.06, 0.07, -0.08])
#: The control's worst error 0.02: zeros are honest where |reference| <= 0.02 + 0.0156; the
#: budget (4 x 0.02 + one ulp = 0.0956) is wide enough for every zero below (0.08 is within
#: it): only the distribution rule can tell them apart.
CONTROL = Control(ControlErrors(max_abs=0.02, rel_l2=0.01), reduction=64)


def test_zeros_within_a_rounding_of_the_output_scale_are_expected() -> None:
    # the control's worst error plus one bfloat16 ulp at 3.0
    assert chance_zero_reach(CONTROL.errors, EXPECTED, "bfloat16") == 0.02 + 2.0**-6
    actual = EXPECTED.to(torch.bfloat16)
    actual[10] = actual[20] = 0.0
    assert compare_point(actual, EXPECTED, "p", CONTROL, None).passed


def test_a_zeroed_run_of_values_at_the_output_scale_still_fails() -> None:
    actual = EXPECTED.to(torch.bfloat16)
    actual[30:34] = 0.0
    result = compare_point(actual, EXPECTED, "p", CONTROL, None)
    assert not result.passed and result.rule == "distribution"
    assert "4 of 128 values" in result.reason


def test_honest_zeros_elsewhere_do_not_pay_for_a_zeroed_run() -> None:
    # zeros are judged position by position: two chance zeros (at 0.004 and -0.012) and the
    # zeroed run together still fail on the run
    actual = EXPECTED.to(torch.bfloat16)
    actual[10] = actual[20] = 0.0
    actual[30:34] = 0.0
    result = compare_point(actual, EXPECTED, "p", CONTROL, None)
    assert not result.passed and "4 of 128 values" in result.reason


def test_float32_reaches_only_the_controls_error() -> None:
    # one float32 ulp at 3.0 is 2**-22: the reach is the control's error and that ulp
    reach = chance_zero_reach(CONTROL.errors, EXPECTED, "float32")
    assert reach == 0.02 + 2.0**-22


def test_zeros_within_the_honest_error_of_a_large_output_are_expected() -> None:
    # a deep model's late layer in bfloat16: values in the thousands, an honest error of
    # hundreds (tiny-deep-llama's decode at layer 22: max abs 344 of a 1686 budget); a
    # candidate whose value lands on zero where the reference is 200 erred honestly
    expected = torch.linspace(-4000.0, 4000.0, 64)
    expected[5], expected[40] = 200.0, -150.0
    control = Control(ControlErrors(max_abs=400.0, rel_l2=0.04), reduction=32 * 24)
    actual = expected.to(torch.bfloat16)
    actual[5] = actual[40] = 0.0
    result = compare_point(actual, expected, "p", control, None)
    assert result.passed, result.message()
    # the same zeros where the honest error is 50 (a point alone, say) are a flush to zero
    tight = Control(ControlErrors(max_abs=50.0, rel_l2=0.005), reduction=32)
    assert not compare_point(actual, expected, "p", tight, None).passed
