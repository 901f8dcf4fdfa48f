"""What a golden set keeps of a tensor it does not keep whole: exact statistics and a sketch.

At 100B+ parameters a set of every point's full tensors is too large to keep (docs/plan.md),
so a capture can keep full tensors at chosen points only (``numalign capture --full-points``)
and, everywhere else, a :class:`TensorStatistics`: the tensor's shape and dtype, its exact
norm, sum, largest magnitude and non-finite counts (over the positions a request's mask
keeps, as replay compares them), and a **sketch**: a CountSketch of ``width`` buckets, each
element added with a sign into one bucket, both chosen by fixed integer hashes of its flat
index (a degree-1 polynomial for the bucket, degree-3 for the sign, modulo the prime
2**31 - 1: pairwise and four-wise independent). The sketch is linear, so the sketch of a
candidate's output minus the golden sketch is the sketch of its error; the squared norm of
a sketch estimates the squared norm of what it sketched, unbiased, with a relative standard
deviation of at most sqrt(2 / width). So a replay can measure a point's relative L2 error,
and with the exact norms its cosine, without the golden tensor: to within
``estimate_margin(width)`` (three standard deviations). The same integer hashes on every
machine and in every process give the same buckets and signs, whatever the CPU.

Engines and the judge share these: the capture computes them (``golden.recorder``), the
judge measures a candidate against them (``compare.statistics``), both here, importing
nothing of numalign.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import torch

#: The modulus of the sketch's hashes, a prime below 2**31: every product of two residues
#: fits an int64.
_PRIME = 2**31 - 1
#: The bucket hash's and the sign hash's coefficients (fixed: a set's sketches and a
#: replay's must agree on every machine).
_BUCKET = (1_103_515_245, 12_345)
_SIGN = (2_147_483_629, 1_664_525, 1_013_904_223, 69_069)
#: Elements hashed at a time (bounds the index temporaries to some 100 MiB).
_CHUNK = 1 << 22
#: The sketch's width by default: its norm estimate within 3 * sqrt(1 / 2048) = 6.6% (three
#: standard deviations), in 8 KiB a tensor.
DEFAULT_WIDTH = 1024


@dataclass(frozen=True, kw_only=True)
class ExactStatistics:
    """A tensor's exact statistics over its finite values: ``norm`` (L2), ``total`` (sum),
    ``absmax``, counts of NaN and infinities, and ``fourth``, the sum of the fourth powers
    (the pooled lean's standard error from statistics, ``compare.lean``; None in sets
    captured by numalign 0.24.0, which kept no such sum)."""

    norm: float
    total: float
    absmax: float
    nan: int
    posinf: int
    neginf: int
    fourth: float | None = None

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    def scalars(self) -> dict[str, Any]:
        """The exact statistics by name, as the manifest stores them."""
        return {f.name: getattr(self, f.name) for f in fields(ExactStatistics)}


@dataclass(frozen=True, kw_only=True)
class TensorStatistics(ExactStatistics):
    """What a set keeps of a tensor it does not keep whole (the module doc): the tensor's
    ``shape`` and ``dtype`` (at the kept positions), its exact statistics and its ``sketch``
    (float64, ``width`` buckets)."""

    shape: tuple[int, ...]
    dtype: str
    sketch: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.sketch.numel())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def statistics_of(tensor: torch.Tensor, width: int = DEFAULT_WIDTH) -> TensorStatistics:
    """``tensor``'s statistics and sketch (non-finite values counted, and left out of the
    norm, sum and sketch)."""
    import torch

    flat = tensor.detach().reshape(-1).to("cpu", torch.float64)
    finite = flat.isfinite()
    values = torch.where(finite, flat, torch.zeros((), dtype=torch.float64))
    return TensorStatistics(
        shape=tuple(tensor.shape),
        dtype=str(tensor.dtype).removeprefix("torch."),
        norm=float(values.norm()),
        total=float(values.sum()),
        absmax=float(values.abs().max()) if values.numel() else 0.0,
        nan=int(flat.isnan().sum()),
        posinf=int((flat == math.inf).sum()),
        neginf=int((flat == -math.inf).sum()),
        fourth=_finite_or_none(float(values.square().square().sum())),
        sketch=sketch(values, width),
    )


def _finite_or_none(value: float) -> float | None:
    """``value``, or None where it overflowed float64 (a fourth power past 1e77)."""
    return value if math.isfinite(value) else None


def sketch(tensor: torch.Tensor, width: int = DEFAULT_WIDTH) -> torch.Tensor:
    """The CountSketch of ``tensor``'s elements in row-major order (float64, ``width``
    buckets; the module doc): linear, so ``sketch(a) - sketch(b) == sketch(a - b)`` up to
    rounding."""
    import torch

    if width < 1:
        raise ValueError(f"a sketch needs at least one bucket, not {width}")
    flat = tensor.detach().reshape(-1).to("cpu", torch.float64)
    out = torch.zeros(width, dtype=torch.float64)
    for start in range(0, flat.numel(), _CHUNK):
        values = flat[start : start + _CHUNK]
        bucket, negative = _hashes(start, values.numel(), width)
        out.index_add_(0, bucket, torch.where(negative, -values, values))
    return out


@lru_cache(maxsize=32)
def _hashes(start: int, count: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The buckets and the negative signs of elements ``start`` to ``start + count`` (a
    set's points share a few sizes: hashed once each in a process)."""
    import torch

    index = torch.arange(start, start + count, dtype=torch.int64) % _PRIME
    bucket = (index * _BUCKET[0] + _BUCKET[1]) % _PRIME % width
    sign = torch.full_like(index, _SIGN[0])
    for coefficient in _SIGN[1:]:  # Horner's rule, every product below 2**62
        sign = (sign * index + coefficient) % _PRIME
    return bucket, sign % 2 == 1


def estimate_margin(width: int) -> float:
    """How far above the truth a sketch's norm estimate of an error may read, relatively,
    at three standard deviations: the squared estimate's relative deviation is at most
    sqrt(2 / width), the norm's half of it."""
    return 3.0 * math.sqrt(0.5 / width)


def distance(actual: torch.Tensor, golden: TensorStatistics) -> float:
    """The estimated L2 norm of ``actual - golden``'s tensor, from ``actual``'s sketch (its
    non-finite values left out, as the golden sketch leaves them) and the golden one."""
    import torch

    flat = actual.detach().reshape(-1).to("cpu", torch.float64)
    finite = torch.where(flat.isfinite(), flat, torch.zeros((), dtype=torch.float64))
    return float((sketch(finite, golden.width) - golden.sketch).norm())


#: What a set keeps of a tensor to judge a candidate against: the tensor, or its statistics.
Expected: TypeAlias = "torch.Tensor | TensorStatistics"
