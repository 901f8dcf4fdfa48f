"""Properties of the verdict over generated tensors (hypothesis)."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from numalign.compare import CompareSpec, compare

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]

# Values within every tested dtype's normal range (float16: 6.1e-5 to 65504), so that the
# truth is representable and the only error is the rounding under test.
magnitudes = st.sampled_from([1e-3, 1e-1, 1.0, 10.0, 300.0])
shapes = st.lists(st.integers(1, 33), min_size=1, max_size=3)
dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**31 - 1)


def make_truth(shape: list[int], magnitude: float, seed: int, outliers: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=torch.float64) * magnitude
    if outliers and t.numel() > 4:
        # a few channels 30x larger, as in real hidden states
        t.view(-1)[:: max(1, t.numel() // 3)] *= 30.0
    return t


@settings(max_examples=60, deadline=None)
@given(shape=shapes, magnitude=magnitudes, seed=seeds, dtype=dtypes, outliers=st.booleans())
def test_identical_tensors_pass(
    shape: list[int], magnitude: float, seed: int, dtype: torch.dtype, outliers: bool
) -> None:
    t = make_truth(shape, magnitude, seed, outliers).to(dtype)
    assert compare(t, t.clone()).passed
    assert compare(t, t.to(torch.float64), CompareSpec(control=t.clone())).passed


@settings(max_examples=60, deadline=None)
@given(shape=shapes, magnitude=magnitudes, seed=seeds, dtype=dtypes, outliers=st.booleans())
def test_honest_rounding_passes_against_a_control_rounded_the_same_way(
    shape: list[int], magnitude: float, seed: int, dtype: torch.dtype, outliers: bool
) -> None:
    t = make_truth(shape, magnitude, seed, outliers)
    result = compare(t.to(dtype), t, CompareSpec(control=t.to(dtype)))
    assert result.passed, result.message()
    without_control = compare(t.to(dtype), t)
    assert without_control.passed, without_control.message()


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(64, 4096),
    magnitude=magnitudes,
    seed=seeds,
    dtype=dtypes,
    sign=st.sampled_from([-1.0, 1.0]),
)
def test_two_percent_scale_error_fails_in_every_dtype(
    n: int, magnitude: float, seed: int, dtype: torch.dtype, sign: float
) -> None:
    # 64 elements or more: a 2% error is 2.5 bfloat16 roundings, so it shows in aggregate
    # (relative L2, norm ratio), not reliably in any single element.
    t = make_truth([n], magnitude, seed, outliers=False)
    result = compare((t * (1 + sign * 0.02)).to(dtype), t, CompareSpec(control=t.to(dtype)))
    assert not result.passed


@settings(max_examples=60, deadline=None)
@given(shape=shapes, magnitude=magnitudes, seed=seeds, dtype=dtypes, data=st.data())
def test_a_nan_at_a_new_position_fails(
    shape: list[int], magnitude: float, seed: int, dtype: torch.dtype, data: st.DataObject
) -> None:
    t = make_truth(shape, magnitude, seed, outliers=False)
    actual = t.to(dtype).clone()  # .to() of the same dtype would alias the truth
    position = data.draw(st.integers(0, actual.numel() - 1))
    actual.view(-1)[position] = math.nan
    result = compare(actual, t, CompareSpec(control=t.to(dtype)))
    assert (result.passed, result.rule) == (False, "non-finite")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(8, 2048), seed=seeds, dtype=dtypes, scale=st.sampled_from([1e-6, 1e-7]))
def test_all_zeros_where_the_truth_is_small_fails(
    n: int, seed: int, dtype: torch.dtype, scale: float
) -> None:
    t = make_truth([n], scale, seed, outliers=False)
    result = compare(torch.zeros(n, dtype=dtype), t)
    assert not result.passed
    assert result.rule in ("distribution", "tolerance")


@settings(max_examples=40, deadline=None)
@given(
    shape=shapes,
    magnitude=magnitudes,
    seed=seeds,
    dtype=dtypes,
    noise=st.sampled_from([0.0, 0.01, 0.05]),
)
def test_results_do_not_depend_on_element_order(
    shape: list[int], magnitude: float, seed: int, dtype: torch.dtype, noise: float
) -> None:
    t = make_truth(shape, magnitude, seed, outliers=False)
    actual = (t * (1 + noise * torch.randn(shape, dtype=torch.float64))).to(dtype)
    control = t.to(dtype)
    perm = torch.randperm(t.numel(), generator=torch.Generator().manual_seed(seed))

    def shuffled(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1)[perm].reshape(shape)

    a = compare(actual, t, CompareSpec(control=control))
    b = compare(shuffled(actual), shuffled(t), CompareSpec(control=shuffled(control)))
    assert (a.passed, a.rule) == (b.passed, b.rule)
    for name in ("max_abs", "max_rel", "ulp_max", "ulp_p99", "mismatch_count"):
        assert getattr(a.metrics, name) == getattr(b.metrics, name), name
    for name in ("mean_abs", "rmse", "rel_l2", "cosine", "norm_ratio"):
        # float64 sums in another order differ by a few units of 1e-16
        assert math.isclose(getattr(a.metrics, name), getattr(b.metrics, name), rel_tol=1e-12)


# Adversarial values for the metric identities: exact zeros, float32 subnormals and the edge
# of float32's normal range, tiny probabilities next to large ones, and ordinary values.
adversarial = st.sampled_from([0.0, 1e-45, 1e-40, 1e-38, 1.2e-38, 3e-6, 0.25, 1.0, 300.0])


@settings(max_examples=80, deadline=None)
@given(
    # up to three chunks of the metric pass (2**16 elements each), so that a maximum taken in
    # an early chunk must survive the later ones
    n=st.sampled_from([1, 7, 1000, (1 << 16) + 3, 3 * (1 << 16) - 5]),
    values=st.lists(adversarial, min_size=1, max_size=6),
    seed=seeds,
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    where=st.floats(0.0, 1.0),
)
def test_metrics_are_consistent_with_each_other(
    n: int, values: list[float], seed: int, dtype: torch.dtype, where: float
) -> None:
    from numalign.compare import compute_metrics

    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(values, dtype=torch.float64)
    expected = pool[torch.randint(len(values), (n,), generator=gen)]
    expected = expected * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    actual = expected.to(dtype).clone()
    # one element off where the truth may be exactly zero (a kept token the truth cut)
    position = min(int(where * n), n - 1)
    actual[position] = actual[position] + 3e-6
    m = compute_metrics(actual, expected)
    true_max = float((actual.double() - expected).abs().max())
    assert m.max_abs == true_max, (m.max_abs, true_max)
    assert m.max_abs >= m.mean_abs
    assert m.rmse <= m.max_abs * (1 + 1e-12)  # rmse is a mean of squares: never above the max
    assert m.mean_abs <= m.rmse * (1 + 1e-12)
    assert math.isfinite(m.ulp_max) and math.isfinite(m.ulp_p99)
    assert m.ulp_p99 <= m.ulp_max
