"""Systematic error below one rounding per element: statistics that average over elements.

A per-element budget sits at the dtype's own noise: a bfloat16 output rounds by up to 2**-8
of its magnitude, so an error of 0.1% passes every element of it. When thousands of elements
lean the same way, though, their mean resolves the lean far below one rounding: the standard
error of a mean of n independent roundings is the rounding over sqrt(n). Two leans are
measured, each with its standard error:

- ``scale``: the error's regression on the reference through zero, d = scale * e + r (a
  wrong epsilon, a missing or doubled scale, a normalizer accumulated in low precision);
- ``offset``: the mean signed error over the reference's root mean square (a bias added
  where none belongs, an activation's other form leaning one way);

and per channel (the last dimension, where a point has one) the largest of either over the
channels, which resolves a lean confined to some channels or heads (a rotary section in the
wrong order, a routing bias in one expert's combine weight).

Honest implementations lean too, and alike: in bfloat16 every one of them multiplies the same
rounded weights, so the reference run in the dtype has a lean of its own. A candidate is
therefore judged against the leans the honest ensemble of the calibration reached
(``<lean>_low`` and ``<lean>_high`` over members; ``channel_<lean>`` the largest), spanned
both ways (the members run the same code and share its roundings; an implementation that
rounds elsewhere leans anywhere between none and as much the other way), with the sample
size in the decision: it fails when its lean lies beyond that range by more than ``LEAN_Z``
of its own standard errors plus ``LEAN_SPREAD`` times the range's width plus a floor of
the dtype's unit roundoff (``LEAN_FLOOR_ROUNDOFFS``; for a reduction, the accumulator's walk);
the three are the policy's (``Thresholds.lean_z``, ``lean_spread``, ``lean_floor_roundoffs``).

Leans are judged for a module alone on the golden inputs (layer replay), where every honest
implementation is fed the same values, and inside the whole model (model and decode replay),
where they are not: there an honest implementation's upstream noise, through the nonlinear
modules after it and through depth, leans outputs by far more than any module's own lean
(measured in the honest matrix: an honest fused RMSNorm leaned tiny-deep-llama's 16th layer
0.23% in float16, 4.6 roundings). Inside the model the honest range is therefore widened both
ways by ``upstream``, the honest ensemble's relative L2 error of the point as the model runs
(its accumulated or decode calibration): an error of relative size r leans its output by at
most r, scale or offset alike (Cauchy-Schwarz: |<d, e>| / <e, e> <= |d| / |e|, and
|mean(d)| <= rms(d)). The widening is a bound, not a fit: an honest error is mostly not along
the reference and leans by a fraction of r, while a systematic scale is all lean. The range's
width in the ``LEAN_SPREAD`` term stays the members' own, and per-channel leans are judged
alone only (a channel's errors share their upstream: the paged engine's honest float16 decode
leaned 3.3% in one channel of 32). So a scale at the model's first norms, where the upstream
error is a few roundings of the embeddings, fails in the whole model too (a LayerNorm divided
by the unbiased variance, 0.89% small on the zoo's GPT-2, outside an allowance of 0.41%),
while deep in the model the allowance grows with the honest error it stands for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from numalign.compare.metrics import signed_percent
from numalign.compare.tolerances import (
    FLOAT_FORMATS,
    LEAN_CHANNEL_ROWS,
    LEAN_MIN_ELEMENTS,
    Thresholds,
)
from numalign.core.statistics import Expected, TensorStatistics, distance

if TYPE_CHECKING:
    import torch

    from numalign.compare.calibration import ControlStats

#: The global leans, in the order they are judged.
LEANS = ("scale", "offset")


@dataclass(frozen=True)
class Lean:
    """A tensor's (or a point's pooled) leans against its reference, each with its standard
    error."""

    scale: float
    scale_se: float
    offset: float
    offset_se: float
    #: the per-channel scale and offset most standard errors from zero (0 without channels)
    channel_scale: float
    channel_scale_se: float
    channel_offset: float
    channel_offset_se: float
    channels: int
    elements: int

    def stats(self) -> dict[str, float]:
        """The leans as a calibration stores them (one sample: low and high are the lean)."""
        return {
            "scale_low": self.scale, "scale_high": self.scale,
            "offset_low": self.offset, "offset_high": self.offset,
            "channel_scale": abs(self.channel_scale), "channel_offset": abs(self.channel_offset),
        }  # fmt: skip


class LeanSums:
    """Sufficient statistics of the leans over any number of tensors of one point's output
    (every request, call and step pooled: the more elements, the finer the lean resolved),
    per channel (the last dimension)."""

    _NAMES = ("n", "ee", "de", "d", "dd", "eedd", "eeed", "eeee")

    def __init__(self) -> None:
        self.sums: dict[str, Any] | None = None
        self.mixed = False  # outputs of different channel counts: global leans only

    def add(self, actual: torch.Tensor, expected: Expected) -> None:
        """``actual``'s sums against ``expected``: the tensor, per channel; or the statistics
        a set keeps of it (``statistics_sums``: global only, so the pool's per-channel leans
        are then left out)."""
        import torch

        if isinstance(expected, TensorStatistics):
            found = statistics_sums(actual, expected)
            if found is not None:
                self._pool(found)
            return
        if actual.shape != expected.shape or not actual.numel():
            return
        a = actual.detach().to(torch.float64)
        e = expected.detach().to(torch.float64).to(a.device)
        channels = int(a.shape[-1]) if a.dim() >= 2 else 1
        a, e = a.reshape(-1, channels), e.reshape(-1, channels)
        keep = a.isfinite() & e.isfinite()
        zero = torch.zeros((), dtype=torch.float64, device=a.device)
        e = torch.where(keep, e, zero)
        d = torch.where(keep, a, zero) - e
        ee, de = e * e, d * e
        new = {
            "n": keep.sum(0).to(torch.float64), "ee": ee.sum(0), "de": de.sum(0), "d": d.sum(0),
            "dd": (d * d).sum(0), "eedd": (ee * d * d).sum(0), "eeed": (ee * de).sum(0),
            "eeee": (ee * ee).sum(0),
        }  # fmt: skip
        self._pool({k: v.cpu() for k, v in new.items()})

    def _pool(self, new: dict[str, torch.Tensor]) -> None:
        if self.sums is None:
            self.sums = new
        elif self.sums["n"].shape == new["n"].shape and not self.mixed:
            self.sums = {k: self.sums[k] + new[k] for k in self._NAMES}
        else:  # keep the global sums only
            self.mixed = True
            self.sums = {k: (self.sums[k].sum() + new[k].sum()).reshape(1) for k in self._NAMES}

    def finish(self) -> Lean | None:
        """The pooled leans (None with fewer than ``LEAN_MIN_ELEMENTS`` finite elements or a
        reference of zeros)."""
        if self.sums is None:
            return None
        s = self.sums
        total = {k: float(v.sum()) for k, v in s.items()}
        n = int(total["n"])
        if n < LEAN_MIN_ELEMENTS or total["ee"] <= 0.0:
            return None
        rms = math.sqrt(total["ee"] / n)
        scale, scale_se = _slope(total)
        offset, offset_se = _mean(total, rms)
        channels = int(s["n"].numel())
        best = {"scale": (0.0, 0.0), "offset": (0.0, 0.0)}
        if channels > 1 and n // channels >= LEAN_CHANNEL_ROWS:
            per = [{k: float(v[c]) for k, v in s.items()} for c in range(channels)]
            slopes = [_slope(c) for c in per if c["ee"] > 0 and c["n"] > 1]
            means = [_mean(c, rms) for c in per if c["n"] > 1]
            best = {"scale": _most_significant(slopes), "offset": _most_significant(means)}
        return Lean(scale, scale_se, offset, offset_se, *best["scale"], *best["offset"],
                    channels, n)  # fmt: skip


def statistics_sums(
    actual: torch.Tensor, golden: TensorStatistics
) -> dict[str, torch.Tensor] | None:
    """The lean's sums of ``actual`` against a tensor kept as ``golden`` statistics, over all
    its elements (one channel); None where the shapes differ or the set kept no sum of fourth
    powers (numalign 0.24.0's sets).

    The reference's sums are exact (|e|^2 the norm squared, the sum, sum e^4); the error's
    square |d|^2 is the sketches' estimate (``core.statistics.distance``), and the error's
    projection on the reference follows from the exact norms: d.e = (|a|^2 - |e|^2 - |d|^2)
    / 2. The estimate's noise (relative standard deviation at most sqrt(2 / width) in |d|^2)
    moves d.e by at most |d|^2 / sqrt(2 * width) (one standard deviation), a lean of a tiny
    fraction of rel_l2^2, and is added to the slope's variance. The element-wise sums the
    slope's robust standard error needs (sum e^2 d^2, sum e^3 d) are those of errors relative
    to the reference, d_i = (beta + eps_i) e_i with eps of variance v = RSS / |e|^2: rounding
    errors are relative, and for errors of any other spread across elements this variance
    is the larger one (n sum e^4 >= (sum e^2)^2). Both variances read |d|^2 one standard
    deviation above its estimate: in an honest output the residual is most of |d|^2 and its
    estimate is as good as the sketch's; where a lean is most of it, what is left is a
    small difference of large sums and may read low, but the lean is then many standard
    errors beyond any honest one anyway (``LEAN_Z`` of them are needed)."""
    import torch

    if golden.fourth is None or tuple(actual.shape) != golden.shape or not golden.numel:
        return None
    flat = actual.detach().reshape(-1).to("cpu", torch.float64)
    finite = flat.isfinite()
    values = torch.where(finite, flat, torch.zeros((), dtype=torch.float64))
    ee = golden.norm * golden.norm
    dd = distance(actual, golden) ** 2
    de = (float(values.square().sum()) - ee - dd) / 2.0
    beta = de / ee if ee > 0 else 0.0
    most = dd * (1.0 + math.sqrt(2.0 / golden.width))  # one standard deviation above
    v = max(most - beta * de, 0.0) / ee if ee > 0 else 0.0
    eeee = golden.fourth
    sums = {
        "n": float(golden.numel - max(int((~finite).sum()), golden.nonfinite)),
        "ee": ee, "de": de, "d": float(values.sum()) - golden.total,
        "dd": most,
        "eedd": (beta * beta + v) * eeee + dd * dd / (2.0 * golden.width),
        "eeed": beta * eeee, "eeee": eeee,
    }  # fmt: skip
    return {k: torch.tensor([value], dtype=torch.float64) for k, value in sums.items()}


def lean(actual: torch.Tensor, expected: torch.Tensor) -> Lean | None:
    """The leans of one tensor against its reference (``LeanSums`` of it alone)."""
    sums = LeanSums()
    sums.add(actual, expected)
    return sums.finish()


def _slope(s: dict[str, float]) -> tuple[float, float]:
    """The regression of d on e through zero and its heteroscedasticity-robust standard
    error (each element's residual r = d - beta * e weighs by e**2), from the sums."""
    beta = s["de"] / s["ee"]
    eerr = s["eedd"] - 2.0 * beta * s["eeed"] + beta * beta * s["eeee"]
    return beta, math.sqrt(max(eerr, 0.0)) / s["ee"]


def _mean(s: dict[str, float], unit: float) -> tuple[float, float]:
    """The mean of d and its standard error, in ``unit`` (the reference's RMS)."""
    n = s["n"]
    mean = s["d"] / n
    var = max(s["dd"] - n * mean * mean, 0.0) / max(n - 1.0, 1.0)
    return mean / unit, math.sqrt(var / n) / unit


def _most_significant(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """The (lean, standard error) most standard errors from zero; (0, 0) of none."""
    if not pairs:
        return 0.0, 0.0
    return max(pairs, key=lambda p: abs(p[0]) / p[1] if p[1] > 0 else math.inf * abs(p[0]))


@dataclass(frozen=True)
class LeanFinding:
    """A lean beyond the honest range: which, how far (in the candidate's standard errors),
    and the words the verdict says."""

    name: str
    value: float
    low: float
    high: float
    z: float
    used: float

    #: the widening of the range for upstream error inside the model (0: alone)
    upstream: float = 0.0

    def reason(self, lean_: Lean) -> str:
        where = (
            f"across {lean_.elements} elements"
            if not self.name.startswith("channel")
            else f"in one of {lean_.channels} channels"
        )
        kind = "scale" if self.name.endswith("scale") else "offset of the mean error"
        widened = (
            f", widened by ±{100 * self.upstream:.3g}% for the honest error upstream of it in "
            "the model"
            if self.upstream
            else ""
        )
        return (
            f"values are within the budget but share a systematic {kind} of "
            f"{signed_percent(self.value)} "
            f"{where} ({self.z:.3g} standard errors beyond the honest ensemble's range "
            f"[{signed_percent(self.low)}, {signed_percent(self.high)}]{widened})"
        )


def judge_lean(
    measured: Lean,
    calibration: ControlStats,
    dtype: str = "bfloat16",
    reduction: int = 1,
    thresholds: Thresholds | None = None,
    upstream: float | None = None,
) -> LeanFinding | None:
    """The lean of ``measured`` farthest beyond what the calibration's honest members reach
    (see the module's docstring); None when every lean is within, or the calibration has
    none. ``upstream``: None for a module alone; inside the model, the honest relative L2
    error of the point there, which widens the global leans' range both ways (per-channel
    leans are then not judged)."""
    t = thresholds or Thresholds()
    findings = _findings(measured, calibration, dtype, reduction, t, upstream)
    failing = [f for f in findings if f.used > 1.0]
    return max(failing, key=lambda f: f.used) if failing else None


def lean_uses(
    measured: Lean,
    calibration: ControlStats,
    dtype: str = "bfloat16",
    reduction: int = 1,
    thresholds: Thresholds | None = None,
    upstream: float | None = None,
) -> list[float]:
    """How far each lean goes towards its limit (1: at it); ``upstream`` as ``judge_lean``."""
    t = thresholds or Thresholds()
    return [f.used for f in _findings(measured, calibration, dtype, reduction, t, upstream)]


def _floor(dtype: str, reduction: int, roundoffs: float) -> float:
    """The least lean judged: ``roundoffs`` (``LEAN_FLOOR_ROUNDOFFS``) of the dtype's unit
    roundoff, or, for
    a reduction of length K, sqrt(K) unit roundoffs of the float32 accumulator (float64 for
    float64): an honest kernel summing in another order shares that error over a row."""
    acc = FLOAT_FORMATS["float64" if dtype == "float64" else "float32"][0]
    walk = math.sqrt(reduction) * 2.0 ** -(acc + 1) if reduction > 1 else 0.0
    return max(roundoffs * 2.0 ** -(FLOAT_FORMATS[dtype][0] + 1), walk)


def lean_limit(
    name: str,
    measured: Lean,
    calibration: ControlStats,
    dtype: str = "bfloat16",
    reduction: int = 1,
    thresholds: Thresholds | None = None,
    upstream: float | None = None,
) -> float | None:
    """How far from zero the global lean ``name`` (``scale``, ``offset``) of a candidate
    with ``measured``'s standard error may go before ``judge_lean`` fails it: the honest
    range's reach (widened by ``upstream`` inside the model) plus its margin (``_beyond``);
    None where the calibration holds no range of it. A planted scale s moves the scale lean
    by exactly s and a planted offset of b RMS the offset lean by b, neither moving its
    standard error (the residual is unchanged): ``compare.power`` reads the pooled lean's
    power from this."""
    t = thresholds or Thresholds()
    honest_range = calibration.lean_range(name)
    se = float(getattr(measured, f"{name}_se"))
    if honest_range is None or not math.isfinite(se):
        return None
    reach = max(abs(honest_range[0]), abs(honest_range[1]))
    wide = 0.0 if upstream is None or not math.isfinite(upstream) else abs(upstream)
    floor = _floor(dtype, reduction, t.lean_floor_roundoffs)
    return reach + wide + _margin(se, 2.0 * reach, floor, t)


def _findings(
    measured: Lean,
    calibration: ControlStats,
    dtype: str,
    reduction: int,
    t: Thresholds,
    upstream: float | None = None,
) -> list[LeanFinding]:
    floor = _floor(dtype, reduction, t.lean_floor_roundoffs)
    wide = 0.0 if upstream is None or not math.isfinite(upstream) else abs(upstream)
    findings = []
    for name in LEANS:
        honest_range = calibration.lean_range(name)
        if honest_range is None:
            continue
        low, high = honest_range
        # the members run the same code and share its roundings (a table rounded to the
        # dtype, say); an honest implementation that rounds elsewhere leans anywhere between
        # none (exact) and as much the other way: the range spans the largest lean both ways
        reach = max(abs(float(low)), abs(float(high)))
        value, se = getattr(measured, name), getattr(measured, f"{name}_se")
        found = _beyond(name, value, se, -reach - wide, reach + wide, floor, t, 2.0 * reach)
        findings.append(None if found is None else replace(found, upstream=wide))
    if upstream is not None:  # inside the model: a channel's errors share their upstream
        return [f for f in findings if f is not None]
    for name in ("channel_scale", "channel_offset"):
        honest = getattr(calibration, name)
        se = getattr(measured, f"{name}_se")
        if honest is None or measured.channels < 2 or not se:
            continue
        value = abs(getattr(measured, name))
        findings.append(_beyond(name, value, se, 0.0, float(honest), floor, t))
    return [f for f in findings if f is not None]


def _beyond(
    name: str,
    value: float,
    se: float,
    low: float,
    high: float,
    floor: float,
    t: Thresholds,
    width: float | None = None,
) -> LeanFinding | None:
    """``name``'s lean beyond [low, high] over its margin (``width``: the members' range's,
    for the ``lean_spread`` term; by default high - low)."""
    if not (math.isfinite(value) and math.isfinite(se)):
        return None
    width = high - low if width is None else width
    margin = _margin(se, width, floor, t)
    outside = value - high if value > high else low - value if value < low else 0.0
    used = outside / margin if margin > 0 else (math.inf if outside > 0 else 0.0)
    z = outside / se if se > 0 else math.inf
    return LeanFinding(name, value, low, high, z, used)


def _margin(se: float, width: float, floor: float, t: Thresholds) -> float:
    """How far beyond the honest range a lean may lie: ``lean_z`` of its standard errors,
    ``lean_spread`` of the range's ``width``, and the ``floor``."""
    return t.lean_z * se + t.lean_spread * width + floor
