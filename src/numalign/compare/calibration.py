"""A golden set's calibration as typed objects, and the control a model verdict takes from it.

The calibration (docs/comparison.md) is the honest ensemble's error in one dtype, per capture
point (or ``(output)``, ``(cache)``), per output path, per mode (``isolated``, ``accumulated``,
``decode``): ``ControlStats``. ``golden.manifest`` reads and writes it (the JSON's key order
kept, so a manifest read and written again is the same bytes); the types live here, so that
the verdict needs nothing above ``compare`` and ``golden`` imports them.

``control_for`` turns a point's statistics into the ``Control`` its comparison is judged
against: its own ensemble's, and for a dtype finer than the calibrated 16-bit ones the
closest of those, scaled (``BORROWED_CALIBRATIONS``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Literal, Protocol

from numalign.compare.metrics import ControlErrors
from numalign.compare.tolerances import (
    BORROWED_CALIBRATIONS,
    FLOAT_FORMATS,
    Thresholds,
)

#: The modes a point is calibrated in.
MODES = ("isolated", "accumulated", "decode")

#: Where a statistic's worst lies: its largest value, its smallest, or farthest from one.
Worst = Literal["largest", "smallest", "farthest_from_one"]

#: The errors a calibration measures per point output (the worst over requests and calls).
ERROR_STATISTICS = ("max_abs", "rel_l2", "mean_abs", "ulp_p99", "max_expected")
#: The logits' agreement measured beside the errors of the model's outputs.
LOGITS_STATISTICS = ("kl_max", "top1_unexplained", "top5_unexplained")
#: The honest range of the errors' leans (``compare.lean``) a pooled lean is judged against.
LEAN_STATISTICS = ("scale_low", "scale_high", "offset_low", "offset_high", "channel_scale",
                   "channel_offset")  # fmt: skip
#: The ensemble's statistics of its members (``replay.ensemble``).
SPREAD_STATISTICS = ("max_abs_spread", "rel_l2_spread")

#: Every calibration statistic, declared once, with the direction of its worst. Merging
#: samples (requests, calls, steps, the ensemble's members) keeps each one's worst, so a
#: merge does not depend on the samples' order. ``ControlStats`` has one field per entry.
STATISTICS: dict[str, Worst] = {
    **dict.fromkeys(ERROR_STATISTICS, "largest"),
    # the distribution: the lowest cosine, the norm ratio farthest from 1, the largest
    # fraction of exact zeros, the most non-finite values beyond the golden ones
    "cosine": "smallest",
    "norm_ratio": "farthest_from_one",
    "zero_fraction": "largest",
    "nonfinite": "largest",
    **dict.fromkeys(LOGITS_STATISTICS, "largest"),
    # a lean's range widens both ways: its low end is the smallest, its high end the largest;
    # a channel's lean is a magnitude
    "scale_low": "smallest",
    "scale_high": "largest",
    "offset_low": "smallest",
    "offset_high": "largest",
    "channel_scale": "largest",
    "channel_offset": "largest",
    # a routing's fraction of tokens whose chosen experts differ from the golden ones
    "flips": "largest",
    **dict.fromkeys(SPREAD_STATISTICS, "largest"),
    # the fewest members a merged entry rests on is the weakest claim it makes
    "members": "smallest",
}


def worst_of(name: str, values: Iterable[float]) -> float | None:
    """The worst of ``values`` of the statistic ``name`` (``STATISTICS``; one this numalign
    does not know: the largest, so that a merge never depends on the order). NaN is not a
    measurement (a calibration stores it as None) and is left out; None where nothing is
    left."""
    finite_or_inf = [float(v) for v in values if not math.isnan(v)]
    if not finite_or_inf:
        return None
    worst = STATISTICS.get(name, "largest")
    if worst == "smallest":
        return min(finite_or_inf)
    if worst == "farthest_from_one":
        # ties (1 - d and 1 + d) go to the larger, whatever their order
        return max(finite_or_inf, key=lambda v: (abs(v - 1.0), v))
    return max(finite_or_inf)


def merge_statistics(samples: Iterable[Mapping[str, float | None]]) -> dict[str, float | None]:
    """Every statistic any sample has, at its worst over the samples that measured it (None
    where none did): the one merge of calibration samples (requests, calls and decode steps
    in ``replay.calibrate``, the ensemble's members in ``replay.ensemble``). Statistics come
    in ``STATISTICS``' order, then unknown ones sorted, whatever the samples' order."""
    pooled: dict[str, list[float]] = {}
    for sample in samples:
        for name, value in sample.items():
            values = pooled.setdefault(name, [])
            if value is not None:
                values.append(float(value))
    order = [n for n in STATISTICS if n in pooled] + sorted(set(pooled) - set(STATISTICS))
    return {name: worst_of(name, pooled[name]) for name in order}


#: The calibration's name for the model's own outputs (logits, an encoder's hidden states).
OUTPUT_POINT = "(output)"
#: The calibration's name for the KV cache's contents (per layer: keys, values, states).
CACHE_POINT = "(cache)"


@dataclass(frozen=True)
class ControlStats:
    """The calibration of one point output in one mode and dtype: the worst over requests,
    calls (and decode steps) and the ensemble's members. None: not measured (older sets), or
    not finite. ``keys`` is the order the statistics were stored in (written back as read);
    ``extra`` holds statistics this numalign does not know (kept, never judged)."""

    #: errors against the golden values (the largest)
    max_abs: float | None = None
    rel_l2: float | None = None
    mean_abs: float | None = None
    ulp_p99: float | None = None
    max_expected: float | None = None
    #: the control's distribution: the lowest cosine, the norm ratio farthest from 1, the
    #: largest fraction of exact zeros, non-finite values beyond the golden ones
    cosine: float | None = None
    norm_ratio: float | None = None
    zero_fraction: float | None = None
    nonfinite: float | None = None
    #: the logits' agreement (``(output)``, ``logits``): KL and unexplained top-1/top-5
    kl_max: float | None = None
    top1_unexplained: float | None = None
    top5_unexplained: float | None = None
    #: the range of the isolated errors' leans (``compare.lean``)
    scale_low: float | None = None
    scale_high: float | None = None
    offset_low: float | None = None
    offset_high: float | None = None
    channel_scale: float | None = None
    channel_offset: float | None = None
    #: a router's routing (``compare.routing``): the largest fraction of tokens whose chosen
    #: experts differ from the golden ones
    flips: float | None = None
    #: the ensemble: the worst over the smallest member's, and the members' count
    max_abs_spread: float | None = None
    rel_l2_spread: float | None = None
    members: float | None = None
    extra: Mapping[str, float | None] = field(default_factory=dict)
    keys: tuple[str, ...] = ()

    @classmethod
    def of(cls, values: Mapping[str, float | None]) -> ControlStats:
        """The statistics of ``values`` (as the calibration measured or stored them)."""
        known = {f.name for f in fields(cls)} - {"extra", "keys"}
        return cls(
            **{k: v for k, v in values.items() if k in known},
            extra={k: v for k, v in values.items() if k not in known},
            keys=tuple(values),
        )

    def values(self) -> dict[str, float | None]:
        """Every statistic by name, in the order stored."""
        order = self.keys or tuple(
            f.name
            for f in fields(self)
            if f.name not in ("extra", "keys") and getattr(self, f.name) is not None
        )
        return {k: self.extra[k] if k in self.extra else getattr(self, k) for k in order}

    def lean_range(self, lean: str) -> tuple[float, float] | None:
        """The honest range of ``lean`` (``scale``, ``offset``); None where not measured."""
        low, high = getattr(self, f"{lean}_low"), getattr(self, f"{lean}_high")
        return None if low is None or high is None else (float(low), float(high))


@dataclass
class Calibration:
    """One dtype's calibration: ``points[point][output path][mode]``, in the order stored."""

    points: dict[str, dict[str, dict[str, ControlStats]]] = field(default_factory=dict)

    def stats(self, point: str, path: str, mode: str) -> ControlStats | None:
        """The statistics of one point output and mode (None where the set has none)."""
        return self.points.get(point, {}).get(path, {}).get(mode)

    def entries(self) -> Iterator[tuple[str, str, str, ControlStats]]:
        """(point, output path, mode, statistics) of every entry, in the order stored."""
        for point, outputs in self.points.items():
            for path, modes in outputs.items():
                for mode, stats in modes.items():
                    yield point, path, mode, stats


class Calibrated(Protocol):
    """What holds a calibration (a ``GoldenSet``): one point output's statistics by dtype
    and mode, None where it has none (or its max abs is not finite)."""

    def calibrated(self, dtype: str, point: str, path: str, mode: str) -> ControlStats | None:
        """The statistics, or None."""
        ...

    def calibrated_paths(self, dtype: str, point: str) -> list[str]:
        """The output paths of ``point`` the calibration of ``dtype`` holds (in any mode)."""
        ...


@dataclass(frozen=True)
class Control:
    """A point's control in one dtype, from the set's calibration: its errors (budget and
    distribution), the reduction length behind the point, and for logits the control's KL."""

    errors: ControlErrors
    reduction: int
    kl_max: float | None = None
    calibrated: bool = True
    #: the point runs inside the whole model (accumulated, decode, the model's outputs):
    #: honest differences upstream reach it
    propagated: bool = False
    #: a routing's control: the fraction of tokens the honest ensemble routes apart
    flips: float | None = None
    #: measured on whole tensors; False where the calibration measured the point on the
    #: statistics a set keeps of it (no max abs error): a tensor judged against it is
    #: judged as the statistics are (``compare.model_verdict.compare_point``)
    whole: bool = True


def control_for(
    golden: Calibrated,
    dtype: str,
    point: str,
    path: str,
    mode: str,
    hidden: int,
    depth: int,
    thresholds: Thresholds | None = None,
) -> Control:
    """The control of a point's output in ``dtype`` (the set's calibration), and the
    reduction length behind it (the hidden size; times the depth for accumulated points).

    A dtype finer than the calibrated 16-bit ones (float32, float64) is also judged by the
    closest of those (``BORROWED_CALIBRATIONS``), scaled, and the control is the worse of
    that and its own ensemble calibration (where the set has one). The reference model
    amplifies an error the same way in every dtype (linear error propagation), so what
    matters is the error each operation makes. A float16 kernel (float32 accumulation, one
    rounding) errs by about one float16 rounding; a float32 kernel that sums a reduction of
    length K in another order (a fused norm, other threads, another device) errs by up to
    sqrt(K) float32 roundings. The borrowed errors therefore scale by s = 2**-13 *
    sqrt(hidden) (the ratio of unit roundoffs times the reduction's walk,
    ``thresholds.borrowed_reduction_walk``); errors and the
    norm ratio's deviation from 1 by s, 1 - cosine and KL, quadratic in the error, by s**2.
    The ensemble samples the kernels it can select (instruction sets, threads, attention);
    the scaled bound covers an implementation that reorders every reduction, which no member
    does (an honest fused RMSNorm errs several times the ensemble's worst in float32:
    docs/golden-sets.md).

    An output the ensemble cannot measure in ``dtype`` (attention weights: the float32
    members run SDPA, which returns none) borrows alone, raised by how far the point's other
    outputs calibrated in ``dtype`` exceed their own borrowed estimate (``_own_excess``): the
    same upstream error reaches every output of a point, so an output the ensemble cannot
    measure exceeds its borrowed estimate as the point's measured outputs do."""
    propagated = mode in ("accumulated", "output", "decode")
    reduction = hidden * (depth if propagated else 1)
    own = _calibration(golden, dtype, point, path, mode)
    candidates = [_scaled(own, 1.0)] if own is not None else []
    walk = (thresholds or Thresholds()).borrowed_reduction_walk
    borrowed = _borrowed(golden, dtype, point, path, mode, hidden, walk)
    if borrowed is not None:
        stats, scale = borrowed
        if own is None:
            scale *= _own_excess(golden, dtype, point, mode, hidden, walk)
        candidates.append(_scaled(stats, scale))
    if not candidates:
        return Control(ControlErrors(max_abs=0.0, rel_l2=0.0), reduction, calibrated=False)
    worst = merge_statistics(
        {"max_abs": c.errors.max_abs, "rel_l2": c.errors.rel_l2, "cosine": c.errors.cosine,
         "norm_ratio": c.errors.norm_ratio, "zero_fraction": c.errors.zero_fraction,
         "kl_max": c.kl, "flips": c.flips}
        for c in candidates
    )  # fmt: skip
    return Control(
        ControlErrors(
            max_abs=float(worst["max_abs"] or 0.0),
            rel_l2=float(worst["rel_l2"] or 0.0),
            cosine=1.0 if worst["cosine"] is None else float(worst["cosine"]),
            norm_ratio=worst["norm_ratio"],
            zero_fraction=worst["zero_fraction"],
        ),
        reduction,
        kl_max=worst["kl_max"],
        propagated=propagated,
        flips=worst["flips"],
        whole=all(c.whole for c in candidates),
    )


def _borrowed(
    golden: Calibrated, dtype: str, point: str, path: str, mode: str, hidden: int, power: float
) -> tuple[ControlStats, float] | None:
    """The closest 16-bit calibration and the scale that carries it to ``dtype`` (see
    ``control_for``), for dtypes finer than it; None for the 16-bit dtypes themselves or
    where neither is calibrated."""
    if dtype not in FLOAT_FORMATS or dtype in BORROWED_CALIBRATIONS:
        return None
    for source in BORROWED_CALIBRATIONS:
        stats = _calibration(golden, source, point, path, mode)
        if stats is not None:
            roundoff = 2.0 ** (FLOAT_FORMATS[source][0] - FLOAT_FORMATS[dtype][0])
            # sqrt(hidden) ** 1.0 is sqrt(hidden) exactly: the default walk adds no rounding
            walk = math.sqrt(hidden) ** (2 * power)
            return stats, (roundoff * walk if roundoff < 1 else roundoff)
    return None


def _own_excess(
    golden: Calibrated, dtype: str, point: str, mode: str, hidden: int, power: float
) -> float:
    """How far the outputs of ``point`` calibrated in ``dtype`` exceed their borrowed
    estimate in ``mode``: the largest ratio of own to borrowed max abs or relative L2 over
    them, at least 1 (1 where no output has both)."""
    excess = 1.0
    for sibling in golden.calibrated_paths(dtype, point):
        own = _calibration(golden, dtype, point, sibling, mode)
        borrowed = _borrowed(golden, dtype, point, sibling, mode, hidden, power)
        if own is None or borrowed is None:
            continue
        stats, scale = borrowed
        for mine, theirs in ((own.max_abs, stats.max_abs), (own.rel_l2, stats.rel_l2)):
            if mine is not None and theirs and math.isfinite(float(mine)):
                excess = max(excess, float(mine) / (float(theirs) * scale))
    return excess


@dataclass(frozen=True)
class _Scaled:
    """A calibration's statistics as a control's: errors, KL and a routing's flips."""

    errors: ControlErrors
    kl: float | None
    flips: float | None
    whole: bool


def _scaled(stats: ControlStats, scale: float) -> _Scaled:
    """A calibration's statistics as the control's errors (scaled by ``scale``), KL (by its
    square) and a routing's flips (by ``scale``: flips are the near ties an error of that
    size moves across, as many as the error is large where the scores spread smoothly)."""
    norm_ratio, kl = stats.norm_ratio, stats.kl_max
    errors = ControlErrors(
        # none for a point kept as statistics only, whose judge reads no max abs
        max_abs=float(stats.max_abs or 0.0) * scale,
        rel_l2=float(stats.rel_l2 or 0.0) * scale,
        cosine=1.0 - (1.0 - float(stats.cosine or 1.0)) * scale**2,
        norm_ratio=None if norm_ratio is None else 1.0 + (float(norm_ratio) - 1.0) * scale,
        zero_fraction=stats.zero_fraction,
    )
    flips = None if stats.flips is None else min(1.0, float(stats.flips) * scale)
    # measured on statistics only: a relative L2 error without a max abs one
    whole = stats.max_abs is not None or stats.rel_l2 is None
    return _Scaled(errors, None if kl is None else float(kl) * scale**2, flips, whole)


def _calibration(
    golden: Calibrated, dtype: str, point: str, path: str, mode: str
) -> ControlStats | None:
    # the model's own outputs are calibrated as the whole model runs
    return golden.calibrated(dtype, point, path, "accumulated" if mode == "output" else mode)
