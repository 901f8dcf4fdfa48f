"""The verdict rules, in order, across dtypes; failure messages pinned."""

import math

import pytest
import torch

from numalign.compare import (
    CompareSpec,
    Tolerance,
    TolerancePolicy,
    assert_aligned,
    compare,
)
from numalign.compare.policy import Override
from numalign.compare.tolerances import Budget

FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def truth(n: int = 4096, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + FP8_DTYPES, ids=str)
def test_honest_rounding_passes_against_the_same_rounding_as_control(dtype: torch.dtype) -> None:
    t = truth()
    result = compare(t.to(dtype), t, CompareSpec(control=t.to(dtype)))
    assert result.passed, result.message()
    assert result.rule == "budget"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + FP8_DTYPES, ids=str)
def test_honest_rounding_passes_the_table_without_control(dtype: torch.dtype) -> None:
    t = truth()
    result = compare(t.to(dtype), t)
    assert result.passed, result.message()
    assert result.rule == "tolerance"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_two_percent_scale_error_fails(dtype: torch.dtype) -> None:
    t = truth()
    result = compare((t * 1.02).to(dtype), t, CompareSpec(control=t.to(dtype)))
    assert not result.passed
    assert result.rule == "budget"
    assert "mostly a scale" in (result.hint or "")


def test_shape_mismatch_is_a_failing_result() -> None:
    result = compare(
        torch.zeros(4, 8), torch.zeros(4, 9, dtype=torch.float64), CompareSpec(name="linear")
    )
    assert (result.passed, result.rule) == (False, "shape")
    assert "shape (4, 8) differs from the reference's (4, 9)" in result.message()


def test_control_must_share_the_candidates_dtype_and_shape() -> None:
    t = truth(8)
    with pytest.raises(ValueError, match="control dtype float32 != candidate dtype bfloat16"):
        compare(t.to(torch.bfloat16), t, CompareSpec(control=t.float()))
    with pytest.raises(ValueError, match="control shape"):
        compare(t.float(), t, CompareSpec(control=t[:4].float()))


def test_unknown_operator_class_suggests_the_closest() -> None:
    with pytest.raises(ValueError, match="Did you mean 'normalization'"):
        compare(torch.zeros(1), torch.zeros(1), CompareSpec(op_class="normalisation"))


def test_unsupported_float_dtype_names_the_supported_ones() -> None:
    x = torch.zeros(2, dtype=torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="unsupported dtype 'float8_e4m3fnuz'"):
        compare(x, torch.zeros(2, dtype=torch.float64))


def test_nan_at_a_new_position_fails_whatever_the_other_metrics() -> None:
    t = truth(64)
    actual = t.float()
    actual[17] = math.nan
    result = compare(actual, t, CompareSpec(tolerance=Tolerance(rtol=1.0, atol=1e9)))
    assert (result.passed, result.rule) == (False, "non-finite")
    assert "a NaN appears at (17) where the reference is finite" in result.reason


def test_matching_nan_and_inf_positions_pass() -> None:
    t = truth(16)
    t[3], t[5], t[7] = math.nan, math.inf, -math.inf
    result = compare(t.float(), t)
    assert result.passed, result.message()


def test_inf_of_the_other_sign_fails() -> None:
    t = truth(16)
    t[5] = math.inf
    actual = t.float()
    actual[5] = -math.inf
    result = compare(actual, t)
    assert (result.passed, result.rule) == (False, "non-finite")


def test_candidate_hiding_a_reference_nan_fails() -> None:
    t = truth(16)
    t[2] = math.nan
    actual = t.float().nan_to_num(0.0)
    result = compare(actual, t)
    assert (result.passed, result.rule) == (False, "non-finite")
    assert "differ from the reference's at (2)" in result.reason


def test_all_zeros_where_the_truth_is_tiny_fails_the_distribution_rule() -> None:
    t = torch.full((256,), 1e-6, dtype=torch.float64) * (1 + truth(256).abs())
    result = compare(torch.zeros(256), t)
    assert (result.passed, result.rule) == (False, "distribution")
    assert "norm ratio is 0" in result.reason


def test_values_within_tolerance_but_scaled_fail_the_distribution_rule() -> None:
    t = truth(4096) * 1e-5  # |t| < 5e-5: atol 1e-5 lets a 5% scale error (< 2.5e-6) through
    result = compare((t * 1.05).float(), t)
    assert (result.passed, result.rule) == (False, "distribution")


def test_zeroed_tile_fails_even_when_the_values_are_tiny() -> None:
    t = truth(4096) * 1e-7
    actual = t.float()
    actual[:512] = 0.0  # 12.5% exact zeros, within atol 1e-5 of the truth
    result = compare(actual, t)
    assert not result.passed
    assert result.rule == "distribution"


def test_subnormal_outputs_do_not_raise_false_alarms() -> None:
    # float16 spaces values below 2**-14 by 2**-24: rounding alone is a 10% relative error.
    t = truth(1024).abs() * 2.0**-21
    result = compare(t.half(), t)
    assert result.passed, result.message()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.bool], ids=str)
def test_integers_and_booleans_compare_exactly(dtype: torch.dtype) -> None:
    e = torch.tensor([1, 0, 1, 1]).to(dtype)
    assert compare(e.clone(), e).passed
    a = e.clone()
    a[1] = 1
    result = compare(a, e)
    assert (result.passed, result.rule) == (False, "exact")
    assert result.metrics.mismatch_count == 1


def test_integer_outputs_allow_an_explicit_atol() -> None:
    e = torch.tensor([10, -3, 127], dtype=torch.int8)
    a = torch.tensor([11, -3, 126], dtype=torch.int8)
    assert compare(a, e, CompareSpec(tolerance=Tolerance(rtol=0.0, atol=1.0))).passed
    assert not compare(a, e).passed


def test_topk_indices_may_differ_among_ties_only() -> None:
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.9, 0.2]])
    reference = torch.tensor([[1, 3, 2]])
    swapped = torch.tensor([[3, 1, 2]])
    assert compare(swapped, reference, CompareSpec(ties=scores)).passed
    other_tie = torch.tensor([[1, 3, 2]])
    assert compare(other_tie, reference, CompareSpec(ties=scores)).passed
    wrong = torch.tensor([[1, 3, 4]])  # 0.2 is not tied with 0.5
    result = compare(wrong, reference, CompareSpec(ties=scores))
    assert (result.passed, result.rule) == (False, "ties")
    duplicate = torch.tensor([[1, 1, 2]])
    assert "selected twice" in compare(duplicate, reference, CompareSpec(ties=scores)).reason
    out_of_range = torch.tensor([[1, 3, 5]])
    assert "out of range" in compare(out_of_range, reference, CompareSpec(ties=scores)).reason


def test_ties_resolve_equal_scores_in_any_order() -> None:
    scores = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert compare(torch.tensor([[2, 0]]), torch.tensor([[0, 1]]), CompareSpec(ties=scores)).passed


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
def test_fp8_errors_are_measured_in_fp8_ulps(dtype: torch.dtype) -> None:
    t = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    result = compare(t.to(dtype), t)
    assert result.metrics.ulp_max == 0.0
    off = (t * 1.5).to(dtype)
    assert not compare(off, t, CompareSpec(control=t.to(dtype))).passed


def test_empty_tensor_passes() -> None:
    result = compare(torch.empty(0, 7), torch.empty(0, 7, dtype=torch.float64))
    assert result.passed


def test_tensors_are_compared_across_devices_and_layouts() -> None:
    t = truth(64).reshape(8, 8)
    actual = t.float().t().contiguous().t()  # same values, column-major strides
    assert not actual.is_contiguous()
    assert compare(actual, t).passed


def test_reduction_length_scales_the_tables_atol() -> None:
    t = torch.zeros(4, dtype=torch.float64)
    a = torch.full((4,), 1e-4)  # 1e-4 > 2e-5 (matmul float32 atol) but < 2e-5 * sqrt(4096)
    assert not compare(a, t, CompareSpec(op_class="matmul")).passed
    result = compare(a, t, CompareSpec(op_class="matmul", reduction_length=4096))
    assert result.budget["atol"] == pytest.approx(2e-5 * 64)
    assert result.metrics.mismatch_count == 0


def test_policy_overrides_apply_by_pattern_and_dtype() -> None:
    t = truth(256)
    # errors of 0.6% of the largest value, signs at random: over the budget, not a scale
    signs = torch.randint(0, 2, t.shape, generator=torch.Generator().manual_seed(1)) * 2 - 1
    candidate = (t + 0.006 * t.abs().max() * signs).to(torch.bfloat16)
    control = t.to(torch.bfloat16)
    assert not compare(candidate, t, CompareSpec(control=control, name="rms_norm")).passed
    loose = TolerancePolicy((Override(match="rms_*", dtype="bfloat16", budget=Budget(20.0, 20.0)),))
    loosened = compare(candidate, t, CompareSpec(control=control, name="rms_norm", policy=loose))
    assert loosened.passed, loosened.message()
    assert not compare(
        candidate, t, CompareSpec(control=control, name="softmax", policy=loose)
    ).passed


def test_assert_aligned_raises_with_the_message_and_returns_the_result() -> None:
    t = truth(16)
    assert assert_aligned(t.float(), t).passed
    with pytest.raises(AssertionError, match=r"is not aligned"):
        assert_aligned((t * 2).float(), t, CompareSpec(name="gelu"))


def test_budget_failure_message_is_pinned() -> None:
    expected = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    control = expected.to(torch.bfloat16)
    actual = control.clone()
    actual[1, 1] = 4.125  # 4 ulps of bfloat16 at 4 (spacing 2**-5)
    result = compare(actual, expected, CompareSpec(control=control, name="rms_norm"))
    assert result.message() == (
        "rms_norm [bfloat16, 2x2] is not aligned: max abs error 0.125 exceeds the budget "
        "0.03125 (4 ulp; the control is exact here) (rule: budget)\n"
        "Mismatched elements: 1 / 4 (25.00%)\n"
        "Greatest absolute difference: 0.125 at index (1, 1) (actual 4.125, expected 4)\n"
        "Greatest relative difference: 0.03125; ulp error max 4, p99 4\n"
        # 0.125 / sqrt(30); 30.5 / (sqrt(31.015625) sqrt(30)); sqrt(31.015625 / 30)
        "Relative L2 error: 0.02282; cosine 0.99988244; norm ratio 1.01679\n"
        "Budget: max abs <= 0.03125 = 4 x control 0 + 1 ulp 0.03125; relative L2 <= "
        "0.007812 = 3 x control 0 + eps 0.007812\n"
        "Hint: check accumulation precision (accumulate reductions in float32), epsilon and "
        "masks; the worst element is at (1, 1)\n"
        "Likely cause: unknown (confidence 0.20): 1 of 4 elements carry 90% of the error: too "
        "few to read a pattern from (a single wrong write, an index off by one, a stray value)"
    )


def test_tolerance_failure_message_is_pinned() -> None:
    expected = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    actual = expected.float()
    actual[0, 2] += 0.5
    result = compare(actual, expected, CompareSpec(name="silu"))
    assert result.message() == (
        "silu [float32, 2x3] is not aligned: 1 element(s) exceed atol + rtol * |expected|, "
        "worst by 3.97e+04x (rule: tolerance)\n"  # 0.5 / (1e-5 + 1.3e-6 * 2)
        "Mismatched elements: 1 / 6 (16.67%)\n"
        "Greatest absolute difference: 0.5 at index (0, 2) (actual 2.5, expected 2)\n"
        "Greatest relative difference: 0.25; ulp error max 2.097e+06, p99 2.097e+06\n"
        # 0.5 / sqrt(55); 56 / (sqrt(55) sqrt(57.25)); sqrt(57.25 / 55)
        "Relative L2 error: 0.06742; cosine 0.99797333; norm ratio 1.02025\n"
        "Budget: |actual - expected| <= atol + rtol * |expected| with rtol=1.3e-06, atol=1e-05\n"
        "Hint: check accumulation precision (accumulate reductions in float32), epsilon and "
        "masks; the worst element is at (0, 2)\n"
        "Likely cause: unknown (confidence 0.20): 1 of 6 elements carry 90% of the error: too "
        "few to read a pattern from (a single wrong write, an index off by one, a stray value)"
    )


def test_nan_failure_message_is_pinned() -> None:
    expected = torch.ones(2, 3, dtype=torch.float64)
    actual = expected.float()
    actual[1, 2] = math.nan
    result = compare(actual, expected, CompareSpec(name="softmax", op_class="softmax"))
    assert result.message() == (
        "softmax [float32, 2x3] is not aligned: a NaN appears at (1, 2) where the reference is "
        "finite (rule: non-finite)\n"
        "Mismatched elements: 1 / 6 (16.67%)\n"
        "Greatest absolute difference: 0 at index (0, 0) (actual 1, expected 1)\n"
        "Greatest relative difference: 0; ulp error max 0, p99 0\n"
        "Relative L2 error: 0; cosine 1; norm ratio 1\n"
        "Non-finite: NaN 1 (reference 0), Inf 0 (reference 0)\n"
        "Budget: |actual - expected| <= atol + rtol * |expected| with rtol=5.2e-06, atol=4e-05\n"
        "Hint: a NaN appears at (1, 2) where the reference is finite: check fully masked rows "
        "(softmax over all -inf must give zeros), 0/0 and sqrt or log of negative values\n"
        "Likely cause: nonfinite (confidence 1.00): a NaN appears at (1, 2) where the reference "
        "is finite"
    )


def test_result_serialises_to_json_without_non_finite_numbers() -> None:
    import json

    result = compare(torch.ones(3), torch.zeros(3, dtype=torch.float64))
    text = json.dumps(result.to_dict(), allow_nan=False)
    assert json.loads(text)["metrics"]["rel_l2"] is None  # inf: the truth's norm is zero


def test_a_systematic_scale_below_one_rounding_per_element_fails() -> None:
    t = truth(4096)
    control = t.to(torch.bfloat16)
    # 0.35%: 0.9 unit roundoff of bfloat16, every element within the max-abs budget (the
    # RMSNorm whose sum of squares accumulates in bfloat16)
    leaning = compare(
        (t * 1.0035).to(torch.bfloat16), t, CompareSpec(control=control, name="rms_norm")
    )
    assert (leaning.passed, leaning.rule) == (False, "distribution")
    assert "systematic scale of +0.35" in leaning.reason and "4096 elements" in leaning.reason
    # the same scale on 32 elements is not resolved as shared (the per-element budget rules)
    few = truth(32)
    assert compare(
        (few * 1.0035).to(torch.bfloat16), few, CompareSpec(control=few.to(torch.bfloat16))
    ).passed
    # a float32 normalizer summed over K = 151936 in another order leans up to sqrt(K) unit
    # roundoffs of float32 (sampling's renormalized probabilities): honest
    normalized = (t * (1 + 30 * 2.0**-24)).float()
    assert compare(normalized, t, CompareSpec(control=t.float(), reduction_length=151936)).passed
