"""The readers of a failing float comparison's error for ``compare.cause``: each label's
model of the error held against it, and the thresholds they read by.

``read_cause`` takes the error ``d = actual - expected``, the truth ``e`` and the honest
noise (the control's error, or the dtype's rounding without one), float64 on the CPU and
finite, and tries the labels in the order of its docstring; each reader returns its ``Cause``
where its model explains enough of the error's energy (``LABEL_AT``), else None.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from numalign.compare.result import Cause

if TYPE_CHECKING:
    import torch

__all__ = ["read_cause"]

#: The least share of the error's energy a label's model must explain to be given.
LABEL_AT = 0.6
#: Rank correlation of a row's scale with its norm below which a per-row scale is an
#: epsilon's (a wrong epsilon moves rows the more the smaller their norm).
EPS_RANK = -0.7
#: How many times the largest row's scale the smallest-norm rows' must reach for epsilon
#: (an epsilon's effect falls as 1 / mean square: it spans orders of magnitude).
EPS_RANGE = 10.0
#: Rank correlation of the error with position, beyond the exact leading positions, above
#: which it grows with position.
POSITION_RANK = 0.7
#: A row (or position) is exact within the noise at most this many times the control's
#: error, and carries the error at least ``DIRTY`` times it.
CLEAN, DIRTY = 2.0, 6.0
#: The least ratio of the error to the control's for ``precision`` (below: the failure is
#: at the budget's edge, and honest noise could be all of it).
PRECISION_AT = 1.5
#: The largest relative L2 error a precision loss reaches (float8's unit roundoff is 6%): an
#: error as large as the values is a wrong formula, layout or index, not rounding.
RELATIVE_AT = 0.1
#: The most ``precision`` is trusted: unbiased noise is the least specific signature (a
#: dropped term or a soft cap made hard can look like it), so it stays below one half.
PRECISION_CONFIDENCE = 0.45
#: An error carried by this few elements (90% of its energy) is read as no pattern: every
#: label's model is a statement about many elements (rows, positions, values), and one or
#: two wrong elements fit several of them alike (a 2x2 output with one element wrong read
#: as a mask at 0.95).
FEW_ELEMENTS = 3


def read_cause(
    d: torch.Tensor, e: torch.Tensor, noise: torch.Tensor, energy: float, selection: bool
) -> Cause:
    """The label whose model explains the error ``d`` against the truth ``e`` and the honest
    ``noise`` (same shape, float64, finite; ``energy``: ``sum d**2``, above 0; ``selection``:
    the output is a selection's values), in the order: a clamp, where the error
    lies along a position (position), a per-row scale falling with the norm (epsilon), rows
    exact against rows wrong (mask), the global models (scale, offset), a selection's other
    choice (routing), a scale per row or per channel, channels exact against channels
    wrong (mask, low confidence), precision; else unknown."""
    few = _carriers(d)
    if few <= FEW_ELEMENTS:
        return Cause(
            "unknown",
            f"{few} of {d.numel()} elements carry 90% of the error: too few to read a "
            "pattern from (a single wrong write, an index off by one, a stray value)",
            0.2,
        )
    ee = float((e * e).sum())
    n = d.numel()
    scale = float((d * e).sum()) / ee if ee > 0 else 0.0
    f_scale = scale * scale * ee / energy
    mean = float(d.mean())
    f_offset = n * mean * mean / energy
    clamp = _clamp(d, e, noise, energy)
    if clamp is not None:
        return clamp
    if abs(scale + 1.0) < 0.02 and f_scale >= LABEL_AT:
        zeros = float((e + d == 0).double().mean())
        return Cause(
            "unknown",
            f"the candidate is zero where the truth is not ({_pct(zeros)} of elements are 0): "
            "an overflow or a NaN cleared to zero, or an output never written",
            0.3,
        )
    rows = _rows(d, e, noise, energy, strict=True)
    where = _position(d, noise) or rows or _mask(d, noise, channels=False)
    if where is not None:
        return where
    rms = math.sqrt(ee / n) if n else 0.0
    relative = math.sqrt(energy / ee) if ee > 0 else math.inf
    per_row = _rows(d, e, noise, energy, strict=False) if selection else None
    if per_row is not None and per_row.label == "scale" and scale >= -0.5:
        return per_row  # each token's weights scaled: a normalization, not a choice
    if selection and (f_scale < LABEL_AT or scale < -0.5):  # values of the other end
        return Cause(
            "routing",
            f"a selection's values off by a relative L2 of {relative:.3g}, no scale (it "
            f"explains {_pct(f_scale)}): other elements were chosen",
            0.45,  # a weights' error (a renormalization) can read alike: under one half
        )
    if max(f_scale, f_offset) >= LABEL_AT:
        if f_scale >= f_offset:
            return Cause(
                "scale",
                f"error = {100 * scale:+.3g}% x value explains {_pct(f_scale)} of its energy",
                f_scale,
            )
        spread = math.sqrt(max(energy / n - mean * mean, 0.0))
        return Cause(
            "offset",
            f"a constant shift of {mean:+.3g} ({_g(abs(mean) / rms) if rms else 'inf'} of "
            f"the truth's RMS; the error's spread about it {spread:.3g}) explains "
            f"{_pct(f_offset)} of its energy",
            f_offset,
        )
    found = (
        _rows(d, e, noise, energy, strict=False)
        or _channels(d, e, energy)
        or _mask(d, noise, channels=True)
    )
    if found is not None:
        return found
    return _precision(d, noise, energy, relative, (f_scale, f_offset))


def _clamp(d: torch.Tensor, e: torch.Tensor, noise: torch.Tensor, energy: float) -> Cause | None:
    """The error at the largest magnitudes only: by bins of the truth's magnitude, the lower
    ones exact within the noise, the error in the upper ones, one way (towards zero: a cap;
    away: the truth's cap is softer than the candidate's)."""
    import torch

    flat, ef, nf = d.flatten(), e.flatten(), noise.flatten()
    if flat.numel() < 64:
        return None
    order = ef.abs().argsort()
    bins = 20
    db, nb = flat[order].tensor_split(bins), nf[order].tensor_split(bins)
    per = torch.stack([(x * x).sum() for x in db])
    ref = torch.stack([(x * x).sum() for x in nb]).clamp_min(1e-300)
    q = (per / ref).sqrt()
    dirty = (q >= DIRTY).nonzero()
    if dirty.numel() == 0:
        return None
    first = int(dirty[0])
    if first < bins // 4 or not bool((q[:first] <= CLEAN).all()):
        return None
    share = float(per[first:].sum()) / energy
    top = order[-(flat.numel() * (bins - first) // bins) :]
    signed = -flat[top] * ef[top].sign()
    weight = flat[top] ** 2
    towards = float(weight[signed > 0].sum()) / max(float(weight.sum()), 1e-300)
    one_way = max(towards, 1.0 - towards)
    confidence = share * one_way
    if confidence < LABEL_AT:
        return None
    bound = float(ef.abs()[order[flat.numel() * first // bins]])
    how = "towards zero (capped)" if towards >= 0.5 else "away from zero (the truth's softer cap)"
    return Cause(
        "clamp",
        f"the error lies at |values| >= {bound:.4g} only ({bins - first} of {bins} magnitude "
        f"bins, {_pct(share)} of its energy; below, exact within the control's noise), "
        f"{_pct(one_way)} of it {how}",
        confidence,
    )


def _rows(
    d: torch.Tensor, e: torch.Tensor, noise: torch.Tensor, energy: float, *, strict: bool
) -> Cause | None:
    """A scale per row of the last dimension explaining ``LABEL_AT`` of the error: with
    ``strict``, an epsilon's alone (of one sign, falling with the row's norm over
    ``EPS_RANGE``); else precision where its sign is mixed, a scale where it is of one."""
    if d.dim() < 2 or d.shape[-1] < 2:
        return None
    dr, er = d.reshape(-1, d.shape[-1]), e.reshape(-1, e.shape[-1])
    if dr.shape[0] < 4:
        return None
    ee = (er * er).sum(-1)
    live = ee > 0
    s = (dr * er).sum(-1) / ee.where(live, 1.0)
    s = s.where(live, 0.0)
    explained = float((s * s * ee).sum()) / energy
    if explained < LABEL_AT or int(live.sum()) < 4:
        return None
    weight = s * s * ee
    positive = float(weight[s > 0].sum()) / float(weight.sum())
    one_sign = min(positive, 1 - positive) < 0.1
    if strict:
        norm = ee[live].sqrt()
        rank = _rank_correlation(s.abs()[live], norm)
        small = float(s.abs()[live][norm <= norm.quantile(0.25)].median())
        large = float(s.abs()[live][norm >= norm.quantile(0.75)].median())
        if not (one_sign and rank <= EPS_RANK and small >= EPS_RANGE * max(large, 1e-300)):
            return None
        return Cause(
            "epsilon",
            f"a scale per row, {100 * small:.3g}% at the smallest-norm rows against "
            f"{100 * large:.3g}% at the largest (rank correlation with the norm "
            f"{rank:+.2f}), explains {_pct(explained)} of the error's energy",
            explained * min(1.0, -rank),
        )
    if 0.25 <= positive <= 0.75:
        return Cause(
            "precision",
            f"a scale per row of either sign ({_pct(positive)} of it positive, rows' "
            f"relative error up to {100 * float(s.abs().max()):.3g}%) explains "
            f"{_pct(explained)} of the error's energy, {_g(_ratio(d, noise))}x the control's "
            "error: a row's normalizer computed in low precision",
            PRECISION_CONFIDENCE * explained,
        )
    if one_sign:
        return Cause(
            "scale",
            f"a scale per row of one sign ({100 * float(s[live].min()):+.3g}% to "
            f"{100 * float(s[live].max()):+.3g}%) explains {_pct(explained)} of the error's "
            "energy",
            0.8 * explained,
        )
    return None


def _channels(d: torch.Tensor, e: torch.Tensor, energy: float) -> Cause | None:
    """A scale per channel (the last dimension) explaining ``LABEL_AT`` of the error: a
    weight or block scale applied to the wrong channels."""
    if d.dim() < 2 or d.shape[-1] < 2:
        return None
    dc, ec = d.reshape(-1, d.shape[-1]), e.reshape(-1, e.shape[-1])
    if dc.shape[0] < 4:
        return None
    ee = (ec * ec).sum(0)
    s = (dc * ec).sum(0) / ee.clamp_min(1e-300)
    explained = float((s * s * ee).sum()) / energy
    if explained < LABEL_AT:
        return None
    return Cause(
        "scale",
        f"a scale per channel of the last dimension ({100 * float(s.min()):+.3g}% to "
        f"{100 * float(s.max()):+.3g}%) explains {_pct(explained)} of the error's energy",
        0.8 * explained,
    )


def _profile(d: torch.Tensor, noise: torch.Tensor, dim: int) -> tuple[Any, Any]:
    """Along ``dim``: the error's energy per position, and its ratio to the noise's."""
    other = [k for k in range(d.dim()) if k != dim]
    per = (d * d).sum(other) if other else d * d
    ref = (noise * noise).sum(other) if other else noise * noise
    return per, (per / ref.clamp_min(1e-300)).sqrt()


def _position(d: torch.Tensor, noise: torch.Tensor) -> Cause | None:
    """A rotary or position signature: along a dimension (not the last) the first
    position(s) exact within the noise and the error growing with position beyond them, or
    only the first position exact (the rotation at position 0 is the identity); or the
    frequency-1 channels of a head (the first of each half, or the first pair) the only
    exact ones (the first frequency is 1 in every base)."""
    import torch

    best: Cause | None = None
    for dim in range(d.dim() - 1):
        size = d.shape[dim]
        if size < 8:
            continue
        per, q = _profile(d, noise, dim)
        clean = q <= CLEAN
        if not bool(clean[0]) or bool(clean[1:].all()):
            continue
        start = int((~clean).nonzero()[0])
        if bool((~clean[start:]).double().mean() < 0.9):
            continue  # exact positions among the erroneous ones: a mask's pattern
        tail = per[start:].sqrt()
        if tail.numel() < 4:
            continue
        rank = _rank_correlation(tail, torch.arange(tail.numel(), dtype=tail.dtype))
        quarter = max(1, tail.numel() // 4)
        growth = float(tail[-quarter:].mean() / tail[:quarter].mean().clamp_min(1e-300))
        grows = rank >= POSITION_RANK and growth >= 1.5
        if not grows and (start != 1 or dim != d.dim() - 2):
            continue  # a flat error past exact leading positions: a window's or a mask's,
            # or past position 0 of the sequence ([..., positions, head_dim]): a rotary's
        what = (
            f"grows with position beyond them ({growth:.3g}x from the first quarter to the "
            f"last, rank correlation {rank:+.2f})"
            if grows
            else "is there from position 1 on (a rotation at position 0 is the identity)"
        )
        cause = Cause(
            "position",
            f"along dim {dim} (size {size}) the positions < {start} are exact within the "
            f"control's noise and the error {what}",
            max(min(0.95, rank) * min(1.0, (growth - 1.0) / 2.0), 0.45) if grows else 0.45,
        )
        if best is None or cause.confidence > best.confidence:
            best = cause
    last = d.shape[-1]
    if d.dim() >= 2 and last >= 8 and last % 2 == 0:
        _, q = _profile(d, noise, d.dim() - 1)
        clean = set((q <= CLEAN).nonzero().flatten().tolist())
        dirty = float((q >= DIRTY).double().mean())
        if clean and clean <= {0, 1, last // 2} and dirty >= 0.9 and best is None:
            best = Cause(
                "position",
                f"the error is in {_pct(dirty)} of the {last} channels of a head and the "
                f"channels {sorted(clean)} (the frequency-1 pair of a rotary in any base) "
                "are exact within the control's noise: a rotary base or frequency error",
                0.75,
            )
    return best


def _mask(d: torch.Tensor, noise: torch.Tensor, *, channels: bool) -> Cause | None:
    """Along some dimension (the last's channels with ``channels``, at a confidence under
    one half: a pattern of channels is as often a packing or scale error): some of its
    positions exact within the noise, the others carrying the error, few in between."""
    best: Cause | None = None
    dims = [d.dim() - 1] if channels else range(d.dim() - 1)
    for dim in dims:
        size = d.shape[dim]
        if size < 2:
            continue
        per, q = _profile(d, noise, dim)
        clean, dirty = q <= CLEAN, q >= DIRTY
        if not bool(clean.any()) or not bool(dirty.any()):
            continue
        share = float(per[dirty].sum()) / float(per.sum())
        sharp = float((clean | dirty).double().mean())
        confidence = share * sharp * (0.45 if channels else 0.95)
        if share < 0.9 or sharp < 0.8:
            continue
        if best is None or confidence > best.confidence:
            kind = "channels" if channels else "rows"
            first = tuple(int(i) for i in dirty.nonzero()[:4].flatten())
            best = Cause(
                "mask",
                f"the error lies in {int(dirty.sum())} of {size} {kind} of dim {dim} "
                f"(from {first}) and {int(clean.sum())} are exact within the control's "
                f"noise; those hold {_pct(share)} of its energy",
                confidence,
            )
    return best


def _precision(
    d: torch.Tensor,
    noise: torch.Tensor,
    energy: float,
    relative: float,
    explained: tuple[float, float],
) -> Cause:
    """Unbiased noise a multiple of the control's everywhere (spread like it over the
    elements, of no low rank, and small against the values), or unknown."""
    ratio = _ratio(d, noise)
    rows = d.reshape(-1, d.shape[-1]) if d.dim() else d.reshape(1, 1)
    refs = noise.reshape(rows.shape)
    q = rows.pow(2).sum(-1).sqrt() / refs.pow(2).sum(-1).sqrt().clamp_min(1e-300)
    median = float(q.median())
    similar = float(((q >= median / 3) & (q <= median * 3)).double().mean())
    peaked, peaked_noise = _top_share(d), _top_share(noise)
    rank_one = _rank_one(rows)
    systematic = max(explained)
    why = []
    if relative > RELATIVE_AT:
        why.append(f"relative L2 {relative:.3g}: larger than any rounding")
    if peaked > 2 * peaked_noise + 0.1:
        why.append(f"the largest 1% of elements hold {_pct(peaked)} of it")
    if rank_one is not None and rank_one[0] > rank_one[1]:
        why.append(f"one rank-1 component holds {_pct(rank_one[0])} of it")
    if ratio >= PRECISION_AT and similar >= 0.8 and not why:
        confidence = similar * (1.0 - systematic) * min(1.0, (ratio - 1.0) / 2.0)
        confidence *= PRECISION_CONFIDENCE
        return Cause(
            "precision",
            f"unbiased error {_g(ratio)}x the control's everywhere ({_pct(similar)} of rows "
            f"within 3x of the median ratio {_g(median)}; a scale or shift explains "
            f"{_pct(systematic)} at most): accumulation or storage in low precision",
            confidence,
        )
    f_scale, f_offset = explained
    return Cause(
        "unknown",
        f"no signature explains most of the error (scale {_pct(f_scale)}, offset "
        f"{_pct(f_offset)} of its energy; {_g(ratio)}x the control's error"
        + ("; " + "; ".join(why) if why else "")
        + ")",
        min(0.3, systematic),
    )


def _carriers(d: torch.Tensor) -> int:
    """How few of the largest errors carry 90% of the error's energy."""
    sq = (d * d).flatten().sort(descending=True).values
    total = float(sq.sum())
    return int((sq.cumsum(0) < 0.9 * total).sum()) + 1 if total > 0 else 0


def _top_share(x: torch.Tensor) -> float:
    """The share of ``x``'s energy in its largest 1% of elements (at least one)."""
    sq = (x * x).flatten()
    total = float(sq.sum())
    if total <= 0:
        return 0.0
    k = max(1, sq.numel() // 100)
    return float(sq.topk(k).values.sum()) / total


def _rank_one(rows: torch.Tensor) -> tuple[float, float] | None:
    """The share of the error's energy in its largest singular component, and what noise of
    that shape reaches (twice ``(sqrt m + sqrt n)**2 / (m n)``, at least one half); None for
    fewer than 8 rows or columns."""
    import torch

    m, n = rows.shape
    if m < 8 or n < 8:
        return None
    sample = rows[:: max(1, m // 1024)][:1024, :4096]
    values = torch.linalg.svdvals(sample) ** 2
    m, n = sample.shape
    share = float(values[0] / values.sum().clamp_min(1e-300))
    return share, max(0.5, 2 * (math.sqrt(m) + math.sqrt(n)) ** 2 / (m * n))


def _ratio(d: torch.Tensor, noise: torch.Tensor) -> float:
    ref = float((noise * noise).sum())
    return math.sqrt(float((d * d).sum()) / ref) if ref > 0 else math.inf


def _rank_correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman's rank correlation (ties broken by order; 0 for fewer than 3 values)."""
    if x.numel() < 3:
        return 0.0
    rx = x.argsort().argsort().to(x.dtype)
    ry = y.argsort().argsort().to(x.dtype)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float((rx * rx).sum()) * float((ry * ry).sum()))
    return float((rx * ry).sum()) / den if den > 0 else 0.0


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


def _g(value: float) -> str:
    return f"{value:.3g}"
