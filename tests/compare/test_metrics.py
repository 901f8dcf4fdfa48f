"""Each metric against values computed by hand."""

import math

import pytest
import torch

from numalign.compare import compute_metrics


def test_metrics_of_one_wrong_element_match_hand_computation() -> None:
    actual = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float32)
    expected = torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=torch.float64)
    m = compute_metrics(actual, expected)
    assert m.numel == 4
    assert m.max_abs == 1.0
    assert m.worst_index == (3,)
    assert (m.worst_actual, m.worst_expected) == (4.0, 5.0)
    assert m.mean_abs == 0.25
    assert m.rmse == 0.5  # sqrt(1 / 4)
    assert m.rel_l2 == pytest.approx(1 / math.sqrt(39), rel=1e-15)  # ||e|| = sqrt(1+4+9+25)
    assert m.cosine == pytest.approx(34 / math.sqrt(30 * 39), rel=1e-15)  # <a,e> = 1+4+9+20
    assert m.norm_ratio == pytest.approx(math.sqrt(30 / 39), rel=1e-15)
    assert m.max_rel == pytest.approx(0.2, rel=1e-15)  # 1 / |5|
    # float32 spacing at 5 (exponent 2) is 2**(2 - 23): an error of 1 is 2**21 ulp.
    assert m.ulp_max == 2.0**21
    assert m.ulp_p99 == 2.0**21  # nearest rank ceil(0.99 * 4) = 4: the largest
    assert m.zero_fraction_actual == 0.0
    assert m.max_expected == 5.0
    assert (m.nan_actual, m.nan_expected, m.inf_actual, m.inf_expected) == (0, 0, 0, 0)


def test_ulp_percentile_is_the_nearest_rank() -> None:
    k = torch.arange(200, dtype=torch.float64)
    expected = torch.ones(200, dtype=torch.float64)
    # float32 values 1 + k ulp, exactly representable: ulp errors are exactly k.
    actual = (1.0 + k * 2.0**-23).to(torch.float32)
    m = compute_metrics(actual[torch.randperm(200)], expected)
    assert m.ulp_max == 199.0
    assert m.ulp_p99 == 197.0  # rank ceil(0.99 * 200) = 198 of 0..199


def test_ulp_percentile_spans_chunks() -> None:
    # 3 chunks of 2**16 plus a tail: the histogram path must merge them.
    n = 3 * (1 << 16) + 5
    k = torch.arange(n, dtype=torch.float64) % 1000
    actual = (1.0 + k * 2.0**-23).to(torch.float32)
    m = compute_metrics(actual, torch.ones(n, dtype=torch.float64))
    expected_p99 = torch.kthvalue(k, math.ceil(0.99 * n)).values.item()
    assert m.ulp_p99 == expected_p99
    assert m.ulp_max == 999.0


def test_ulp_below_the_normal_range_uses_the_subnormal_spacing() -> None:
    # float16's smallest subnormal is 2**-24; values below 2**-14 are spaced by it.
    expected = torch.tensor([2.0**-20], dtype=torch.float64)
    actual = torch.tensor([2.0**-20 + 3 * 2.0**-24], dtype=torch.float16)
    assert compute_metrics(actual, expected).ulp_max == 3.0


def test_mismatches_against_a_tolerance_and_a_threshold() -> None:
    from numalign.compare import Tolerance

    expected = torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)
    actual = torch.tensor([1.2, 10.15, 100.2], dtype=torch.float64)
    # allowed = 0.1 + 0.01 |e| = 0.11, 0.2, 1.1; errors 0.2, 0.15, 0.2: only the first fails.
    m = compute_metrics(actual, expected, tolerance=Tolerance(rtol=0.01, atol=0.1))
    assert m.mismatch_count == 1
    assert m.tolerance_ratio == pytest.approx(0.2 / 0.11, rel=1e-12)
    assert compute_metrics(actual, expected, threshold=0.175).mismatch_count == 2


def test_non_finite_values_are_counted_and_excluded() -> None:
    nan, inf = math.nan, math.inf
    actual = torch.tensor([1.0, nan, inf, 4.0, nan])
    expected = torch.tensor([1.0, nan, 3.0, -inf, 5.0], dtype=torch.float64)
    m = compute_metrics(actual, expected)
    assert (m.nan_actual, m.nan_expected, m.inf_actual, m.inf_expected) == (2, 1, 1, 1)
    assert m.nonfinite_index == (2,)  # the first position whose pattern differs
    assert m.mismatch_count == 3  # positions 2, 3, 4
    assert m.max_abs == 0.0  # the only position finite on both sides is equal
    assert m.worst_index == (0,)


def test_empty_and_zero_dim_tensors() -> None:
    empty = compute_metrics(torch.empty(0, 3), torch.empty(0, 3, dtype=torch.float64))
    assert (empty.numel, empty.max_abs, empty.cosine, empty.worst_index) == (0, 0.0, 1.0, None)
    scalar = compute_metrics(torch.tensor(2.5), torch.tensor(2.0, dtype=torch.float64))
    assert scalar.max_abs == 0.5
    assert scalar.worst_index == ()


def test_zero_vectors_have_defined_cosine_and_norm_ratio() -> None:
    zeros = torch.zeros(8, dtype=torch.float64)
    both = compute_metrics(zeros, zeros)
    assert (both.cosine, both.norm_ratio, both.rel_l2) == (1.0, 1.0, 0.0)
    only_actual = compute_metrics(zeros, torch.ones(8, dtype=torch.float64))
    assert (only_actual.cosine, only_actual.norm_ratio, only_actual.zero_fraction_actual) == (
        0.0,
        0.0,
        1.0,
    )
    only_expected = compute_metrics(torch.ones(8, dtype=torch.float64), zeros)
    assert only_expected.rel_l2 == math.inf


def test_non_contiguous_inputs_report_the_logical_index() -> None:
    base = torch.zeros(4, 6, dtype=torch.float64)
    base[1, 4] = 1.0  # transposed, this is position (4, 1)
    m = compute_metrics(base.t(), torch.zeros(6, 4, dtype=torch.float64))
    assert m.worst_index == (4, 1)


def test_guarded_relative_error_near_zero() -> None:
    expected = torch.tensor([1e-30, 1.0], dtype=torch.float64)
    actual = torch.tensor([1e-7, 1.0], dtype=torch.float32)
    # divides by max(|e|, eps32 * max|e|) = 2**-23: a 1e-7 error at a 1e-30 truth is ~0.84,
    # not 1e23.
    m = compute_metrics(actual, expected)
    assert m.max_rel == pytest.approx(float(torch.tensor(1e-7, dtype=torch.float32)) / 2**-23)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_float8_on_both_sides(dtype: torch.dtype) -> None:
    expected = torch.tensor([1.0, -2.0, 448.0 if dtype == torch.float8_e4m3fn else 512.0]).to(dtype)
    actual = torch.tensor([1.0, -2.5, 0.0]).to(dtype)
    m = compute_metrics(actual, expected)
    assert m.max_expected == float(expected.double().abs().max())
    assert m.worst_index == (2,)
