"""The full metric set of one comparison, computed in float64 in one chunked pass.

All metrics are computed over the positions where both tensors are finite; NaN and Inf are
counted separately. Reductions accumulate in float64, so results depend on element order
only at the level of float64 rounding (about 1e-16 relative).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from numalign.compare.tolerances import (
    FLOAT_FORMATS,
    TAIL_EXCEEDANCE,
    TAIL_ORDER_STATISTICS,
    Tolerance,
)
from numalign.core import dtypes

if TYPE_CHECKING:
    import torch

#: Elements per chunk on the CPU: three float64 buffers of 2**16 elements stay in L2 cache,
#: which makes the dozen passes per chunk about three times faster than whole-tensor passes.
_CPU_CHUNK = 1 << 16
#: Elements per chunk elsewhere: large enough that kernel launches do not dominate.
_DEVICE_CHUNK = 1 << 24
#: The ulp histogram keys are the top bits of a float32 (sign, 8 exponent, 4 mantissa bits).
_HIST_SHIFT = 19
_HIST_BINS = 1 << 12  # every float32 bit pattern >> 19, NaN and Inf included
_F64_EXPONENT_MASK = 0x7FF0000000000000


@dataclass(frozen=True)
class Metrics:
    """Every metric of ``actual`` against ``expected`` (the truth). Errors are absolute
    unless named otherwise, in the units of the tensors; ``ulp_*`` are in units of the
    candidate dtype's spacing at each expected value."""

    numel: int
    #: max |a - e|
    max_abs: float
    #: max |a - e| / max(|e|, eps * max|e|): relative error guarded near zero, where any
    #: kernel that sums values of size max|e| has an error floor of eps * max|e|.
    max_rel: float
    #: mean |a - e|
    mean_abs: float
    #: sqrt(mean (a - e)**2)
    rmse: float
    #: ||a - e|| / ||e||  (0 when both are zero; inf when only e is)
    rel_l2: float
    #: <a, e> / (||a|| ||e||)  (1 when both are zero; 0 when only one is)
    cosine: float
    ulp_max: float
    #: 99th percentile (nearest rank) of the ulp error
    ulp_p99: float
    #: elements outside the elementwise tolerance or threshold that was asked for
    mismatch_count: int
    #: max over elements of |a - e| / (atol + rtol |e|) for the tolerance asked for (else 0)
    tolerance_ratio: float
    nan_actual: int
    nan_expected: int
    inf_actual: int
    inf_expected: int
    #: ||a|| / ||e||  (1 when both are zero)
    norm_ratio: float
    #: fraction of exact zeros in actual
    zero_fraction_actual: float
    #: max |e| over finite positions: the output's magnitude
    max_expected: float
    #: position of max |a - e|, with both values there
    worst_index: tuple[int, ...] | None
    worst_actual: float | None
    worst_expected: float | None
    #: position of the first non-finite mismatch (NaN or Inf where the other side differs)
    nonfinite_index: tuple[int, ...] | None = None
    #: error histogram: (floor(log2(ulp error)), count) per occupied octave; None for the
    #: errors below 2**-126 ulp (exact, in practice)
    ulp_octaves: tuple[tuple[int | None, int], ...] = ()

    @property
    def mismatch_fraction(self) -> float:
        return self.mismatch_count / self.numel if self.numel else 0.0

    @classmethod
    def blank(cls, numel: int, *, error: float, agreement: float, **fields: Any) -> Metrics:
        """Metrics not measured element by element: every error metric ``error``, cosine and
        norm ratio ``agreement``, counts 0, no worst index; ``fields`` set the rest."""
        errors = ("max_abs", "max_rel", "mean_abs", "rmse", "rel_l2", "ulp_max", "ulp_p99",
                  "tolerance_ratio", "zero_fraction_actual", "max_expected")  # fmt: skip
        values: dict[str, Any] = dict.fromkeys(errors, error)
        values |= {"cosine": agreement, "norm_ratio": agreement, "mismatch_count": 0}
        values |= dict.fromkeys(("nan_actual", "nan_expected", "inf_actual", "inf_expected"), 0)
        values |= {"worst_index": None, "worst_actual": None, "worst_expected": None}
        return cls(numel=numel, **(values | fields))

    def to_dict(self) -> dict[str, Any]:
        # every field is a number, None or a tuple (immutable): no deep copy to make
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["mismatch_fraction"] = self.mismatch_fraction
        return out


@dataclass(frozen=True)
class ControlErrors:
    """A control's errors against the truth when the control itself is not at hand (a golden
    set's calibration): what the budget and the distribution rule need of it.

    ``norm_ratio`` and ``zero_fraction`` are the control's own distribution (its norm ratio
    farthest from 1, its fraction of exact zeros); when the calibration recorded them, the
    distribution rule is judged relative to them (``calibrated``), as the budget is."""

    max_abs: float
    rel_l2: float
    cosine: float = 1.0
    norm_ratio: float | None = None
    zero_fraction: float | None = None

    @property
    def calibrated(self) -> bool:
        """Whether the control's distribution is known (calibrations from numalign 0.2 on)."""
        return self.norm_ratio is not None

    def as_metrics(self, expected: torch.Tensor) -> Metrics:
        return self.as_statistics(expected.numel(),
                                  _max_abs(expected) if expected.numel() else 0.0)  # fmt: skip

    def as_statistics(self, numel: int, max_expected: float) -> Metrics:
        """The control's metrics for a truth of ``numel`` elements whose largest magnitude
        is ``max_expected`` (a truth kept as statistics only gives just those)."""
        return Metrics.blank(
            numel, error=math.nan, agreement=math.nan,
            max_abs=self.max_abs, rel_l2=self.rel_l2, cosine=self.cosine,
            norm_ratio=1.0 if self.norm_ratio is None else self.norm_ratio,
            zero_fraction_actual=self.zero_fraction or 0.0, max_expected=max_expected,
        )  # fmt: skip


def float_format(dtype: torch.dtype) -> tuple[int, int] | None:
    """(mantissa bits, log2 of the smallest subnormal) of a floating dtype; None otherwise."""
    return FLOAT_FORMATS.get(dtypes.dtype_name(dtype))


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The multi-index of a flat row-major position."""
    index = []
    for size in reversed(shape):
        index.append(flat % size if size else 0)
        flat //= size if size else 1
    return tuple(reversed(index))


def _metric_device(t: torch.Tensor) -> torch.device:
    import torch

    # float64 is not available on MPS; metrics go to the CPU there.
    return torch.device("cpu") if t.device.type == "mps" else t.device


def _nonfinite_split(
    a: torch.Tensor, e: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, int], int | None]:
    """Drops positions where either side is not finite. Returns the finite pairs, the flat
    positions they came from (None when all were finite), the NaN/Inf counts and the first
    flat position where the non-finite patterns differ."""
    import torch

    counts = {"nan_actual": 0, "nan_expected": 0, "inf_actual": 0, "inf_expected": 0, "differ": 0}
    if not a.is_floating_point() and not e.is_floating_point():
        return a, e, None, counts, None
    # A float64 sum is non-finite iff some element is (float32 and narrower cannot overflow
    # it); float64 inputs that overflow it only cost the slow path below.
    if math.isfinite(float(a.sum(dtype=torch.float64))) and math.isfinite(
        float(e.sum(dtype=torch.float64))
    ):
        return a, e, None, counts, None
    nan_a, nan_e = a.isnan(), e.isnan()
    pinf_a, pinf_e = a == math.inf, e == math.inf
    ninf_a, ninf_e = a == -math.inf, e == -math.inf
    counts = {
        "nan_actual": int(nan_a.sum()),
        "nan_expected": int(nan_e.sum()),
        "inf_actual": int((pinf_a | ninf_a).sum()),
        "inf_expected": int((pinf_e | ninf_e).sum()),
    }
    differ = (nan_a != nan_e) | (pinf_a != pinf_e) | (ninf_a != ninf_e)
    counts["differ"] = int(differ.sum())
    first = int(differ.nonzero()[0, 0]) if counts["differ"] else None
    finite = a.isfinite() & e.isfinite()
    positions = finite.nonzero().squeeze(1)
    return a[finite], e[finite], positions, counts, first


def compute_metrics(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    tolerance: Tolerance | None = None,
    threshold: float | None = None,
) -> Metrics:
    """Computes the full metric set of ``actual`` against ``expected``.

    Shapes must be equal. The ulp unit is that of ``actual``'s dtype (integers: 1).
    ``mismatch_count`` counts elements with ``|a - e| > tolerance.atol + tolerance.rtol * |e|``
    when ``tolerance`` is given, else ``|a - e| > threshold`` when that is given, else 0.
    """
    import torch

    if actual.shape != expected.shape:
        raise ValueError(f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    shape = tuple(actual.shape)
    numel = actual.numel()
    fmt = float_format(actual.dtype)
    device = _metric_device(expected)
    a = actual.detach().to(device).reshape(-1)
    e = expected.detach().to(device).reshape(-1)
    a, e, positions, counts, first_bad = _nonfinite_split(a, e)
    nonfinite_mismatches = counts.pop("differ")
    nonfinite_index = unravel(first_bad, shape) if first_bad is not None else None
    n = a.numel()
    if n == 0:
        return Metrics.blank(
            numel, error=0.0, agreement=1.0, mismatch_count=nonfinite_mismatches,
            nonfinite_index=nonfinite_index, **counts,
        )  # fmt: skip

    f64 = torch.float64
    max_expected = _max_abs(e)
    eps = 2.0 ** -fmt[0] if fmt else 0.0
    tiny = torch.finfo(f64).tiny
    guard = max(eps * max_expected, tiny)
    # The ulp unit is guarded as max_rel is: near zero it is the ulp of eps * max|e| (where a
    # kernel summing values of size max|e| has its error floor), never the ulp of zero, so
    # the ulp error is at most about 4 / eps**2 and finite in the float32 it is kept in.
    # (of the larger side's magnitude, so that a truth of zeros or subnormals has a scale too).
    scale = max(max_expected, _max_abs(a))
    ulp_floor = max(2.0 ** fmt[1], _ulp_of(eps * scale, fmt)) if fmt else 0.0
    chunk = _CPU_CHUNK if device.type == "cpu" else _DEVICE_CHUNK
    size = min(chunk, n)
    buf_a = torch.empty(size, dtype=f64, device=device)
    buf_e = torch.empty(size, dtype=f64, device=device)
    buf_d = torch.empty(size, dtype=f64, device=device)
    buf_r = torch.empty(size, dtype=f64, device=device)
    bits = torch.empty(size, dtype=torch.int64, device=device)
    ulps = torch.empty(n, dtype=torch.float32, device=device)
    hist = torch.zeros(_HIST_BINS, dtype=torch.int64, device=device)
    zero = torch.zeros((), dtype=f64, device=device)
    sq_err, sq_a, sq_e, dot_ae, sum_abs = (
        zero.clone(),
        zero.clone(),
        zero.clone(),
        zero.clone(),
        zero.clone(),
    )
    max_rel, ulp_max, tol_ratio = zero.clone(), zero.clone(), zero.clone()
    mismatches = torch.zeros((), dtype=torch.int64, device=device)
    nonzero_a = torch.zeros((), dtype=torch.int64, device=device)
    chunk_max: list[torch.Tensor] = []
    chunk_arg: list[torch.Tensor] = []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        A, E, D, R, B = buf_a[:m], buf_e[:m], buf_d[:m], buf_r[:m], bits[:m]
        A.copy_(a[start : start + m])
        E.copy_(e[start : start + m])
        torch.sub(A, E, out=D)
        sq_err += torch.dot(D, D)
        sq_a += torch.dot(A, A)
        sq_e += torch.dot(E, E)
        dot_ae += torch.dot(A, E)
        nonzero_a += torch.count_nonzero(A)
        D.abs_()
        arg = torch.argmax(D)
        chunk_arg.append(arg + start)
        # a copy: D is the buffer the next chunk overwrites, and D[arg] would be a view of it
        chunk_max.append(D[arg].clone())
        sum_abs += D.sum()
        if tolerance is not None:
            # R = (atol + rtol |e|), then R = |a - e| / R: the elementwise use of the tolerance
            torch.abs(E, out=R).mul_(tolerance.rtol).add_(tolerance.atol).clamp_min_(tiny)
            torch.div(D, R, out=R)
            mismatches += (R > 1.0).sum()
            torch.maximum(tol_ratio, R.max(), out=tol_ratio)
        elif threshold is not None:
            mismatches += (threshold < D).sum()
        torch.abs(E, out=R)
        R.clamp_min_(guard)
        torch.div(D, R, out=R)
        torch.maximum(max_rel, R.max(), out=max_rel)
        if fmt is not None:
            # ulp(e) = 2**floor(log2|e|) * 2**-mantissa, floored at the smallest subnormal:
            # the exponent bits of a float64 with a zero mantissa are exactly 2**floor(log2|e|).
            torch.bitwise_and(E.view(torch.int64), _F64_EXPONENT_MASK, out=B)
            U = B.view(f64).mul_(2.0 ** -fmt[0]).clamp_min_(ulp_floor)
            torch.div(D, U, out=U)
        else:
            U = D
        U32 = ulps[start : start + m]
        U32.copy_(U)
        # the maximum of the float32 copy the percentile ranks, so that p99 <= max exactly
        torch.maximum(ulp_max, U32.max(), out=ulp_max)
        hist += torch.bincount(U32.view(torch.int32) >> _HIST_SHIFT, minlength=_HIST_BINS)

    maxes = torch.stack(chunk_max)
    which = int(torch.argmax(maxes))
    worst_flat = int(chunk_arg[which])
    max_abs = float(maxes[which])
    ulp_p99 = _percentile_from_hist(ulps, hist, n, 0.99)
    ulp_octaves = _octaves(hist)
    norm_a, norm_e = math.sqrt(float(sq_a)), math.sqrt(float(sq_e))
    original_flat = int(positions[worst_flat]) if positions is not None else worst_flat
    return Metrics(
        numel=numel,
        max_abs=max_abs,
        max_rel=float(max_rel),
        mean_abs=float(sum_abs) / n,
        rmse=math.sqrt(float(sq_err) / n),
        rel_l2=_ratio(math.sqrt(float(sq_err)), norm_e, both_zero=0.0),
        cosine=_cosine(float(dot_ae), norm_a, norm_e),
        ulp_max=float(ulp_max),
        ulp_p99=ulp_p99,
        mismatch_count=int(mismatches) + nonfinite_mismatches,
        tolerance_ratio=float(tol_ratio),
        norm_ratio=_ratio(norm_a, norm_e, both_zero=1.0),
        zero_fraction_actual=(n - int(nonzero_a)) / n,
        max_expected=max_expected,
        worst_index=unravel(original_flat, shape),
        worst_actual=float(a[worst_flat]),
        worst_expected=float(e[worst_flat]),
        nonfinite_index=nonfinite_index,
        ulp_octaves=ulp_octaves,
        **counts,
    )


def _ulp_of(magnitude: float, fmt: tuple[int, int]) -> float:
    """One ulp of the format at ``magnitude`` (0 for 0)."""
    if magnitude <= 0 or not math.isfinite(magnitude):
        return 0.0
    return 2.0 ** (math.floor(math.log2(magnitude)) - fmt[0])


def _octaves(hist: torch.Tensor) -> tuple[tuple[int | None, int], ...]:
    """Sums the float32-keyed histogram (exponent and 4 mantissa bits) per octave."""
    per_exponent = hist.view(-1, 16).sum(-1).tolist()  # index = biased float32 exponent
    return tuple(
        (None if exponent == 0 else exponent - 127, int(count))
        for exponent, count in enumerate(per_exponent)
        if count
    )


def _max_abs(t: torch.Tensor) -> float:
    """max |t|; float8 and integer tensors go through float64 (norms do not take them)."""
    import torch

    if t.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        t = t.to(torch.float64)
    return float(torch.linalg.vector_norm(t, math.inf))


def _ratio(num: float, den: float, *, both_zero: float) -> float:
    if den == 0.0:
        return both_zero if num == 0.0 else math.inf
    return num / den


def _cosine(dot: float, norm_a: float, norm_e: float) -> float:
    if norm_a == 0.0 and norm_e == 0.0:
        return 1.0
    if norm_a == 0.0 or norm_e == 0.0:
        return 0.0
    return max(-1.0, min(1.0, dot / (norm_a * norm_e)))


def _percentile_from_hist(values: torch.Tensor, hist: torch.Tensor, n: int, q: float) -> float:
    """Exact nearest-rank percentile of non-negative float32 ``values`` whose histogram of
    ``bits >> _HIST_SHIFT`` is ``hist`` (order-preserving for non-negative floats): the
    histogram finds the bin, then only that bin's values are ranked."""
    import torch

    rank = max(1, math.ceil(q * n))  # 1-based nearest rank
    cum = torch.cumsum(hist, 0)
    b = int(torch.searchsorted(cum, torch.tensor(rank, device=cum.device)))
    before = int(cum[b - 1]) if b > 0 else 0
    in_bin = values[(values.view(torch.int32) >> _HIST_SHIFT) == b]
    return float(torch.kthvalue(in_bin.cpu(), rank - before).values)


def count_rounding_zeros(expected: torch.Tensor, dtype: torch.dtype) -> int:
    """How many finite elements of ``expected`` lie below ``dtype``'s normal range, where a
    kernel may round to zero or flush subnormals to zero (FTZ, common on accelerators)."""
    import torch

    e = expected.detach().reshape(-1).to(torch.float64)
    e = e[e.isfinite()]
    return int((e.abs() < torch.finfo(dtype).tiny).sum()) if e.numel() else 0


def rounding_control(expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The truth rounded once to ``dtype``: the least error any kernel in ``dtype`` has."""
    return expected.detach().to(dtype)


def error_tail(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The level a fresh worst absolute error of ``actual``'s kind exceeds with probability
    about ``TAIL_EXCEEDANCE``: the worst finite error plus ln(1 / TAIL_EXCEEDANCE) times the
    mean excess of the ``TAIL_ORDER_STATISTICS`` largest errors over the next one (an
    exponential tail's scale; at most a tenth of the elements are used, and tensors of fewer
    than 20 elements give their worst error)."""
    import torch

    d = actual.detach().to(torch.float64) - expected.detach().to(torch.float64).to(actual.device)
    d = d.abs().reshape(-1)
    d = d[d.isfinite()]
    k = min(TAIL_ORDER_STATISTICS, d.numel() // 10)
    if k < 2:
        return float(d.max()) if d.numel() else 0.0
    top = torch.topk(d, k + 1).values
    scale = float((top[:k] - top[k]).mean())
    return float(top[0]) + math.log(1.0 / TAIL_EXCEEDANCE) * scale


def signed_percent(fraction: float, digits: int = 3) -> str:
    """``fraction`` as a signed percentage with ``digits`` significant digits: a lean of
    1.3e-8 reads ``+1.3e-06%``, never ``+0.000%`` (fixed decimals would hide the leans that
    the float32 rules judge)."""
    return f"{100.0 * fraction:+.{digits}g}%"
