"""compare() and assert_aligned(): the verdict rules of DESIGN.md ("Tolerance model").

Rules, in order: shape; non-finite positions; exact (integers, booleans, indices) or
tie-aware selection; the error budget against a same-dtype control, or the (dtype, operator
class) table without one; the distribution of values.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from numalign.compare.metrics import (
    ControlErrors,
    Metrics,
    compute_metrics,
    count_rounding_zeros,
    error_tail,
    float_format,
    rounding_control,
)
from numalign.compare.result import CompareResult
from numalign.compare.tolerances import (
    CALIBRATED_DISTRIBUTION_FLOORS,
    DEFAULT_POLICY,
    DISTRIBUTION_THRESHOLDS,
    DTYPE_TOLERANCES,
    FLOAT_FORMATS,
    OP_CLASSES,
    SCALE_ACCUMULATOR_ROUNDOFFS,
    SCALE_MIN_ELEMENTS,
    SCALE_OUTPUT_ROUNDOFFS,
    SCALE_Z,
    ZERO_EXCESS_COUNT,
    ZERO_EXCESS_FRACTION,
    Budget,
    Tolerance,
    TolerancePolicy,
)
from numalign.names import did_you_mean

if TYPE_CHECKING:
    import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def compare(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    op_class: str = "elementwise",
    control: torch.Tensor | None = None,
    control_errors: ControlErrors | None = None,
    reduction_length: int | None = None,
    ties: torch.Tensor | None = None,
    tolerance: Tolerance | None = None,
    budget: Budget | None = None,
    name: str = "output",
    policy: TolerancePolicy | None = None,
    zero_reach: float | None = None,
    propagated: bool = False,
) -> CompareResult:
    """Compares a candidate output with the truth and returns every metric and a verdict.

    Args:
        actual: the candidate's output, any dtype and device.
        expected: the truth (float64 reference or golden tensor), same shape.
        op_class: one of ``OP_CLASSES``; picks the table row when there is no control.
        control: the honest reference computed in ``actual``'s dtype; when given, the error
            budget is a multiple of the control's error against ``expected`` (rule 3).
        control_errors: the control's errors when only they are known (a golden set's
            calibration): used as ``control`` is.
        reduction_length: length of the reduction behind each output element; scales the
            table's atol by its square root (reduction classes only).
        ties: for index outputs (top-k, sort), the scores the indices select from along the
            last dimension; indices may then differ where the scores tie within tolerance.
        tolerance: an explicit elementwise tolerance, replacing the table (and, for integer
            outputs, allowing ``atol`` of difference, e.g. 1 for rounding ties).
        budget: the control multipliers when no pyproject override matches (an operator's
            own, where its honest alternatives round differently by design).
        name: the operator or capture point, for messages and pyproject overrides.
        policy: overrides from ``[tool.numalign]``; the built-in tables when None.
        zero_reach: the reference magnitude up to which an exact zero in the candidate is
            chance (an honest value rounded onto zero); exact zeros then count against the
            distribution rule only where the reference lies beyond it, position by position.
        propagated: the candidate's error includes what honest differences upstream carried
            into it (a point of the whole model, a decode step): against a calibration, its
            norm may then move as far as its relative L2 budget allows, not only as far as
            the control's own error (an isolated point's systematic scale is judged alone).
    """

    if op_class not in OP_CLASSES:
        raise ValueError(
            f"Unknown operator class {op_class!r}; allowed: {', '.join(OP_CLASSES)}."
            + did_you_mean(op_class, OP_CLASSES)
        )
    policy = policy or DEFAULT_POLICY
    shape = tuple(actual.shape)
    dtype = dtype_name(actual.dtype)
    exact = not actual.is_floating_point() or ties is not None
    if not exact and dtype not in FLOAT_FORMATS:
        raise ValueError(
            f"{name}: unsupported dtype {dtype!r}; supported floating dtypes: "
            f"{', '.join(FLOAT_FORMATS)}, and integer or boolean dtypes (compared exactly)."
        )
    result = _Builder(name=name, dtype=dtype, shape=shape, op_class=op_class)

    if actual.shape != expected.shape:
        return result.failed_shape(tuple(expected.shape), "the reference's")
    if control is not None:
        if control.shape != expected.shape:
            raise ValueError(
                f"{name}: control shape {tuple(control.shape)} != reference shape "
                f"{tuple(expected.shape)}; the control is the reference run in the candidate dtype"
            )
        if control.dtype != actual.dtype:
            raise ValueError(
                f"{name}: control dtype {dtype_name(control.dtype)} != candidate dtype {dtype}; "
                "the control must run in the same dtype as the candidate"
            )

    if exact:
        return _exact(result, actual, expected, ties=ties, tolerance=tolerance)

    fmt = FLOAT_FORMATS[dtype]
    eps = 2.0 ** -fmt[0]
    has_control = control is not None or control_errors is not None
    if has_control:
        tail = None
        if control is not None:
            control_metrics = compute_metrics(control, expected)
            tail = error_tail(control, expected)  # the worst error of a fresh draw
        else:
            assert control_errors is not None
            control_metrics = control_errors.as_metrics(expected)
        multipliers = policy.budget(name, dtype, budget)
        # Floors: one ulp of the output at its largest magnitude, and, for a reduction of
        # length K, sqrt(K) ulps of the accumulator (float32; float64 for float64): honest
        # kernels sum in other orders than the control, and sequential sums drift as sqrt(K).
        walk = math.sqrt(reduction_length) if reduction_length and reduction_length > 1 else 0.0
        acc_fmt = FLOAT_FORMATS["float64" if dtype == "float64" else "float32"]
        floor = _ulp(control_metrics.max_expected, fmt)
        accumulation = walk * _ulp(control_metrics.max_expected, acc_fmt)
        worst = max(control_metrics.max_abs, tail or 0.0)
        limit_max = multipliers.max_abs_multiplier * worst + floor + accumulation
        limit_l2 = (
            multipliers.rel_l2_multiplier * control_metrics.rel_l2 + eps + walk * 2.0 ** -acc_fmt[0]
        )
        metrics = compute_metrics(actual, expected, threshold=limit_max)
        result.budget = {
            "max_abs": limit_max,
            "max_abs_multiplier": multipliers.max_abs_multiplier,
            "control_max_abs": control_metrics.max_abs,
            "control_tail": worst,
            "floor": floor,
            "accumulation": accumulation,
            "rel_l2": limit_l2,
            "rel_l2_multiplier": multipliers.rel_l2_multiplier,
            "control_rel_l2": control_metrics.rel_l2,
            "eps": eps,
            "accumulation_rel": walk * 2.0 ** -acc_fmt[0],
        }
        result.control = control_metrics
        result.budget_used = max(_over(metrics.max_abs, limit_max), _over(metrics.rel_l2, limit_l2))
        spread = multipliers.rel_l2_multiplier
    else:
        tol = tolerance or policy.tolerance(name, dtype, op_class, reduction_length)
        metrics = compute_metrics(actual, expected, tolerance=tol)
        result.budget = {"rtol": tol.rtol, "atol": tol.atol}
        if tolerance is None and reduction_length and reduction_length > 1:
            result.budget["reduction_length"] = float(reduction_length)
        result.budget_used = metrics.tolerance_ratio
        control_metrics = None
        spread = policy.budget(name, dtype, budget).rel_l2_multiplier
    result.metrics = metrics

    nonfinite = _nonfinite_reason(metrics)
    if nonfinite:
        return result.fail("non-finite", *nonfinite)

    if has_control:
        if metrics.max_abs > result.budget["max_abs"]:
            times = _times_control(metrics.max_abs, result.budget)
            return result.fail(
                "budget",
                f"max abs error {_g(metrics.max_abs)} exceeds the budget "
                f"{_g(result.budget['max_abs'])} ({times})",
                _error_hint(actual, expected, result.budget["max_abs"], None, metrics),
            )
        if metrics.rel_l2 > result.budget["rel_l2"]:
            return result.fail(
                "budget",
                f"relative L2 error {_g(metrics.rel_l2)} exceeds the budget "
                f"{_g(result.budget['rel_l2'])}",
                _error_hint(actual, expected, None, None, metrics),
            )
    elif metrics.mismatch_count:
        return result.fail(
            "tolerance",
            f"{metrics.mismatch_count} element(s) exceed atol + rtol * |expected|, "
            f"worst by {_g(metrics.tolerance_ratio, 3)}x",
            _error_hint(actual, expected, None, tol, metrics),
        )

    calibrated = control_errors is not None and control_errors.calibrated
    distribution = _distribution(
        actual, expected, metrics, control_metrics, spread, dtype,
        calibrated_budget=result.budget if calibrated else None, zero_reach=zero_reach,
        propagated=propagated,
    )  # fmt: skip
    if distribution is None and control is not None:
        widen = spread / Budget().rel_l2_multiplier  # a budget override widens the floor too
        distribution = _systematic_scale(
            actual, expected, control, dtype, reduction_length, max(1.0, widen)
        )
    if distribution:
        reason, hint, used = distribution
        result.budget_used = max(result.budget_used, used)  # how far past its limit
        return result.fail("distribution", reason, hint)
    rule = "budget" if has_control else "tolerance"
    return result.ok(rule, f"within budget (worst use {_g(result.budget_used, 3)})")


def assert_aligned(
    actual: torch.Tensor,
    expected: torch.Tensor,
    **kwargs: object,
) -> CompareResult:
    """``compare()`` that raises ``AssertionError`` with the formatted result when the
    candidate is not aligned; returns the result otherwise (to record it)."""
    __tracebackhide__ = True
    result = compare(actual, expected, **kwargs)  # type: ignore[arg-type]
    if not result.passed:
        raise AssertionError(result.message())
    return result


class _Builder:
    """Collects the parts of a CompareResult while the rules run."""

    def __init__(self, *, name: str, dtype: str, shape: tuple[int, ...], op_class: str) -> None:
        self.name, self.dtype, self.shape, self.op_class = name, dtype, shape, op_class
        self.metrics: Metrics | None = None
        self.control: Metrics | None = None
        self.budget: dict[str, float] = {}
        self.budget_used = 0.0

    def _build(self, passed: bool, rule: str, reason: str, hint: str | None) -> CompareResult:
        assert self.metrics is not None
        return CompareResult(
            name=self.name,
            dtype=self.dtype,
            shape=self.shape,
            op_class=self.op_class,
            passed=passed,
            rule=rule,
            reason=reason,
            metrics=self.metrics,
            control=self.control,
            budget=self.budget,
            budget_used=self.budget_used,
            hint=hint,
        )

    def ok(self, rule: str, reason: str) -> CompareResult:
        return self._build(True, rule, reason, None)

    def fail(self, rule: str, reason: str, hint: str | None) -> CompareResult:
        self.budget_used = (
            max(self.budget_used, 1.0) if math.isfinite(self.budget_used) else self.budget_used
        )
        return self._build(False, rule, reason, hint)

    def failed_shape(self, expected_shape: tuple[int, ...], whose: str) -> CompareResult:
        self.metrics = Metrics.blank(
            math.prod(self.shape), error=math.nan, agreement=math.nan,
            mismatch_count=math.prod(self.shape),
        )  # fmt: skip
        self.budget_used = math.inf
        return self._build(
            False,
            "shape",
            f"shape {self.shape} differs from {whose} {expected_shape}",
            "check the output layout (transposes, head and sequence order) and dropped or "
            "padded tails",
        )


def _ulp(magnitude: float, fmt: tuple[int, int]) -> float:
    """One ulp of the format at ``magnitude``."""
    if magnitude <= 0 or not math.isfinite(magnitude):
        return 2.0 ** fmt[1]
    return max(2.0 ** (math.floor(math.log2(magnitude)) - fmt[0]), 2.0 ** fmt[1])


def _times_control(error: float, budget: dict[str, float]) -> str:
    if budget["control_max_abs"] > 0:
        return f"{_g(error / budget['control_max_abs'], 3)}x the control's error"
    return f"{_g(error / budget['floor'], 3)} ulp; the control is exact here"


def _over(value: float, limit: float) -> float:
    return value / limit if limit > 0 else (0.0 if value == 0 else math.inf)


def _g(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}g}"


def _nonfinite_reason(m: Metrics) -> tuple[str, str] | None:
    if m.nonfinite_index is None:
        return None
    where = "(" + ", ".join(str(i) for i in m.nonfinite_index) + ")"
    if m.nan_actual > m.nan_expected or (m.nan_actual and m.nan_actual != m.nan_expected):
        return (
            f"a NaN appears at {where} where the reference is finite",
            f"a NaN appears at {where} where the reference is finite: check fully masked rows "
            "(softmax over all -inf must give zeros), 0/0 and sqrt or log of negative values",
        )
    if m.inf_actual > m.inf_expected:
        return (
            f"an Inf appears at {where} where the reference is finite",
            "check overflow: accumulation in a narrow dtype (float16 ends at 65504), a missing "
            "max subtraction before exp, or a division by a value that underflowed",
        )
    return (
        f"the non-finite values differ from the reference's at {where}",
        f"the reference is NaN or Inf at {where} where the candidate differs: the candidate "
        "hides an invalid value or changes its sign; NaN and Inf positions must match exactly",
    )


def _exact(
    result: _Builder,
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    ties: torch.Tensor | None,
    tolerance: Tolerance | None,
) -> CompareResult:

    a = actual.detach().cpu()
    e = expected.detach().to(a.device)
    if ties is not None:
        return _ties(result, a, e, ties.detach().cpu())
    atol = tolerance.atol if tolerance is not None else 0.0
    threshold = atol if atol > 0 else None
    metrics = compute_metrics(a, e, threshold=threshold)
    if threshold is None:
        differ = (a != e).sum()
        metrics = _with_mismatches(metrics, int(differ))
    result.metrics = metrics
    result.budget = {"atol": atol}
    result.budget_used = 0.0 if metrics.mismatch_count == 0 else math.inf
    if metrics.mismatch_count:
        m = metrics
        return result.fail(
            "exact",
            f"{m.mismatch_count} of {m.numel} exact outputs differ"
            + (f" by more than {atol:g}" if atol else ""),
            f"the worst difference is at {m.worst_index} (actual {m.worst_actual:g}, expected "
            f"{m.worst_expected:g}): check off-by-one masks, index arithmetic and "
            "tie-breaking",
        )
    return result.ok("exact", "all exact outputs are equal")


def _with_mismatches(m: Metrics, count: int) -> Metrics:
    from dataclasses import replace

    return replace(m, mismatch_count=count)


def _ties(
    result: _Builder, a: torch.Tensor, e: torch.Tensor, scores: torch.Tensor
) -> CompareResult:
    """Index outputs that may differ only where the selected scores tie."""
    import torch

    n = scores.shape[-1] if scores.dim() else 0
    metrics = compute_metrics(a, e)
    result.metrics = metrics
    if a.is_floating_point() or a.dtype == torch.bool:
        raise ValueError(f"{result.name}: ties= needs integer index outputs, got {a.dtype}")
    if bool(((a < 0) | (a >= n)).any()):
        bad = tuple(int(i) for i in ((a < 0) | (a >= n)).nonzero()[0])
        return result.fail(
            "ties",
            f"index out of range [0, {n}) at {bad}",
            "check the index base and the length of the selected dimension",
        )
    if a.numel() and a.shape[-1] > 1:
        sorted_idx = a.sort(dim=-1).values
        if bool((sorted_idx[..., 1:] == sorted_idx[..., :-1]).any()):
            return result.fail(
                "ties",
                "an index is selected twice in one row",
                "top-k and sort must select distinct positions",
            )
    lead = scores.shape[:-1]
    if a.shape[:-1] != lead:
        raise ValueError(
            f"{result.name}: ties= scores of shape {tuple(scores.shape)} do not match indices "
            f"of shape {tuple(a.shape)} in the leading dimensions"
        )
    picked_a = scores.gather(-1, a.long()).to(torch.float64)
    picked_e = scores.gather(-1, e.long()).to(torch.float64)
    tol = DTYPE_TOLERANCES.get(dtype_name(scores.dtype), DTYPE_TOLERANCES["float64"])
    # Order within tied values is free: compare the selected scores sorted.
    sa = picked_a.sort(dim=-1, descending=True).values
    se = picked_e.sort(dim=-1, descending=True).values
    untied = (sa - se).abs() > tol.atol + tol.rtol * se.abs()
    index_diff = int((a != e).sum())
    result.budget = {"rtol": tol.rtol, "atol": tol.atol}
    count = int(untied.sum())
    result.metrics = _with_mismatches(metrics, count)
    if count:
        return result.fail(
            "ties",
            f"{count} selected score(s) are not tied with the reference's selection within "
            f"rtol={tol.rtol:g}, atol={tol.atol:g}",
            "the candidate selects different elements, not a different order among ties: "
            "check the comparison direction, masking before selection and k",
        )
    return result.ok(
        "ties",
        f"selections agree ({index_diff} index difference(s), all among tied scores)",
    )


def _distribution(
    actual: torch.Tensor,
    expected: torch.Tensor,
    m: Metrics,
    control: Metrics | None,
    spread: float,
    dtype: str,
    *,
    calibrated_budget: dict[str, float] | None = None,
    zero_reach: float | None = None,
    propagated: bool = False,
) -> tuple[str, str, float] | None:
    """Rule 4: values within tolerance but abnormal fail.

    Against a calibrated control (a golden set's calibration, which records the control's
    norm ratio, cosine and zeros; ``calibrated_budget`` is the budget built from it) the limits
    are relative to the control, with the floors the dtype explains. An error of relative L2
    r moves a norm by at most r and a cosine by at most r**2 / 2, so the norm ratio may also
    deviate by the control's whole relative error (plus the budget's accumulation allowance),
    and 1 - cosine by half the square of the relative L2 budget: a systematic scale is flagged
    when it exceeds everything the control's own error explains. Otherwise, the dtype's
    thresholds, relaxed by the control. Returns (reason, hint, deviation over its limit)."""
    if m.numel == 0 or m.worst_index is None:
        return None
    calibrated = calibrated_budget is not None
    table = CALIBRATED_DISTRIBUTION_FLOORS if calibrated else DISTRIBUTION_THRESHOLDS
    norm_tol, cos_tol = table[dtype]
    if calibrated_budget is not None:
        b = calibrated_budget
        # an error of relative L2 r moves a norm by at most r: a point alone by the control's
        # own error (a systematic scale beyond it is the point's), a point fed by upstream
        # honest differences by as much error of the control's kind as the budget allows
        # (its multiplier times the control's; not the eps floor, which stands for the
        # candidate's own extra roundings, unbiased: they cannot move a norm). SmolLM2-135M
        # with an honest fused RMSNorm in bfloat16: norm ratio 0.991 at layer 2's MLP in the
        # whole model, where every member reached 0.998; a 1% scaled RMSNorm still fails at
        # layer 0's norm, where little error comes from upstream.
        control_kind = b["rel_l2_multiplier"] if propagated else 1.0
        norm_tol = max(norm_tol, control_kind * b["control_rel_l2"] + b["accumulation_rel"])
        cos_tol = max(cos_tol, b["rel_l2"] ** 2 / 2)
    references = [control] if control is not None else []

    def limits() -> tuple[float, float]:
        n_tol, c_tol = norm_tol, cos_tol
        for ref in references:
            n_tol = max(n_tol, spread * abs(ref.norm_ratio - 1.0))
            c_tol = max(c_tol, spread**2 * (1.0 - ref.cosine))
        return n_tol, c_tol

    n_tol, c_tol = limits()
    if (abs(m.norm_ratio - 1.0) > n_tol or 1.0 - m.cosine > c_tol) and control is None:
        # No control: the truth rounded to the dtype is the least error any kernel has;
        # outputs that cancel (tiny norm) or sit among subnormals relax the thresholds.
        references.append(compute_metrics(rounding_control(expected, actual.dtype), expected))
        n_tol, c_tol = limits()
    if abs(m.norm_ratio - 1.0) > n_tol:
        small = f" (the reference's largest magnitude is {_g(m.max_expected)})"
        against = (
            f", the calibrated control's {_g(references[0].norm_ratio, 6)}"
            if calibrated and references
            else ""
        )
        return (
            f"values are within tolerance but the norm ratio is {_g(m.norm_ratio, 6)}, off by more "
            f"than {_g(n_tol, 3)}{small}{against}",
            "a systematic scale error: check epsilon (it dominates small inputs), a missing "
            "or doubled scale, and outputs flushed to zero",
            abs(m.norm_ratio - 1.0) / n_tol if n_tol > 0 else math.inf,
        )
    if 1.0 - m.cosine > c_tol:
        return (
            f"values are within tolerance but the cosine similarity is {_g(m.cosine, 8)}, below "
            f"1 - {_g(c_tol, 3)}",
            "the output's direction differs from the reference: check permuted or mixed-up "
            "channels, heads or positions",
            (1.0 - m.cosine) / c_tol if c_tol > 0 else math.inf,
        )
    if m.zero_fraction_actual > 0 and zero_reach is not None:
        return _zeros_beyond_reach(actual, expected, m.numel, zero_reach)
    if m.zero_fraction_actual > 0:
        fmt = float_format(actual.dtype)
        if fmt is not None:
            expected_zero = count_rounding_zeros(expected, actual.dtype) / max(m.numel, 1)
            if control is not None:
                expected_zero = max(expected_zero, control.zero_fraction_actual)
            excess = m.zero_fraction_actual - expected_zero
            allowed = max(ZERO_EXCESS_FRACTION, ZERO_EXCESS_COUNT / max(m.numel, 1))
            if excess > allowed:
                return (
                    f"{100 * m.zero_fraction_actual:.1f}% of the values are exactly zero where the "
                    f"reference rounds to zero at {100 * expected_zero:.1f}%",
                    "outputs flushed to zero: check underflow (flush-to-zero, a missing upcast) "
                    "and skipped tiles or rows",
                    excess / allowed,
                )
    return None


def _slope(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float, int]:
    """The error's regression on the truth through zero, d = beta * e + r: (beta, its
    heteroscedasticity-robust standard error, elements), over the finite elements."""
    import torch

    a = actual.detach().reshape(-1).to(torch.float64)
    e = expected.detach().reshape(-1).to(torch.float64).to(a.device)
    keep = a.isfinite() & e.isfinite()
    a, e = a[keep], e[keep]
    ee = float(e @ e)
    if ee == 0.0 or not math.isfinite(ee):
        return 0.0, math.inf, int(e.numel())
    d = a - e
    beta = float(d @ e) / ee
    r = d - beta * e
    return beta, math.sqrt(float((e * e) @ (r * r))) / ee, int(e.numel())


def _systematic_scale(
    actual: torch.Tensor,
    expected: torch.Tensor,
    control: torch.Tensor,
    dtype: str,
    reduction_length: int | None,
    widen: float = 1.0,
) -> tuple[str, str, float] | None:
    """A scale shared by many elements, resolved below one rounding per element: the
    candidate's slope of error on truth, judged by its standard error (``SCALE_Z``) and by
    how much it exceeds the control's own lean (the floors of ``tolerances.SCALE_*``, times
    ``widen``)."""
    beta, se, n = _slope(actual, expected)
    if n < SCALE_MIN_ELEMENTS:
        return None
    beta_c, _, _ = _slope(control, expected)
    # how much more the candidate leans than the control (a candidate closer to the truth
    # than a control that rounds a shared scale, say, leans less and passes)
    shift = abs(beta) - abs(beta_c)
    roundoff = 2.0 ** -FLOAT_FORMATS[dtype][0] / 2
    acc = 2.0 ** -FLOAT_FORMATS["float64" if dtype == "float64" else "float32"][0] / 2
    walk = math.sqrt(reduction_length) if reduction_length and reduction_length > 1 else 0.0
    floor = widen * max(
        SCALE_ACCUMULATOR_ROUNDOFFS * acc, walk * acc, SCALE_OUTPUT_ROUNDOFFS * roundoff
    )
    z = abs(beta) / se if se > 0 else (math.inf if beta else 0.0)
    if z <= SCALE_Z or shift <= floor:
        return None
    return (
        f"values are within the budget but share a systematic scale of {beta:+.3%} across "
        f"{n} elements ({_g(z, 3)} standard errors; the control's {beta_c:+.3%}), beyond "
        f"what honest rounding leans ({_g(floor, 3)} in {dtype})",
        "a systematic scale below one rounding per element: check accumulation precision "
        "(a sum of squares or a normalizer accumulated in the input dtype), epsilon, and "
        "rounding that truncates instead of rounding to nearest",
        shift / floor,
    )


def _zeros_beyond_reach(
    actual: torch.Tensor, expected: torch.Tensor, numel: int, reach: float
) -> tuple[str, str, float] | None:
    """Exact zeros of the candidate where the reference lies beyond ``reach`` (what honest
    error and one rounding can bring onto zero): more than the allowance fail."""
    a = actual.detach().reshape(-1)
    e = expected.detach().reshape(-1).to(a.device)
    suspicious = int(((a == 0) & e.isfinite() & (e.abs() > reach)).sum())
    allowed = max(ZERO_EXCESS_FRACTION, ZERO_EXCESS_COUNT / max(numel, 1))
    excess = suspicious / max(numel, 1)
    if excess <= allowed:
        return None
    return (
        f"{suspicious} of {numel} values ({100 * excess:.1f}%) are exactly zero where the "
        f"reference lies beyond {_g(reach)}, farther from zero than honest error and one "
        "rounding reach",
        "outputs flushed to zero: check underflow (flush-to-zero, a missing upcast) and "
        "skipped tiles or rows",
        excess / allowed,
    )


def _error_hint(
    actual: torch.Tensor,
    expected: torch.Tensor,
    threshold: float | None,
    tolerance: Tolerance | None,
    m: Metrics,
) -> str:
    """Where the errors are, said so that it points at a cause."""
    import torch

    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    err = (a - e).abs().nan_to_num(0.0)
    if tolerance is not None:
        bad = err > tolerance.atol + tolerance.rtol * e.abs()
    elif threshold is not None:
        bad = err > threshold
    else:
        bad = err > err.mean() + 3 * err.std() if err.numel() > 1 else err > 0
    # The error along the truth's direction, over the whole error (both relative to ||e||):
    # with a = s e + r, <d, e> = s - 1 and ||d||**2 = (s - 1)**2 + ||r||**2.
    along = m.cosine * m.norm_ratio - 1.0
    if m.rel_l2 > 0 and math.isfinite(m.rel_l2) and along**2 > 0.75 * m.rel_l2**2:
        return (
            f"the error is mostly a scale (norm ratio {_g(m.norm_ratio, 6)}, relative L2 error "
            f"{_g(m.rel_l2)}): check epsilon, scaling factors and accumulation precision "
            "(accumulate reductions in float32)"
        )
    if bad.any() and a.dim() > 0:
        where = bad.nonzero()
        for dim in range(a.dim() - 1, -1, -1):
            first = int(where[:, dim].min())
            size = a.shape[dim]
            tail = bad.narrow(dim, first, size - first)
            # A boundary only when most of what lies past it is wrong.
            if first > 0 and size > 1 and float(tail.double().mean()) > 0.5:
                return (
                    f"every mismatch lies at index >= {first} of dim {dim} (size {size}): check "
                    "tails past a tile, chunk, window or page boundary"
                )
    return (
        "check accumulation precision (accumulate reductions in float32), epsilon and masks; "
        f"the worst element is at {m.worst_index}"
    )
