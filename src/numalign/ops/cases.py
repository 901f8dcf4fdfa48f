"""Cases: shapes and value regimes per tier, and deterministic seeded inputs.

Inputs are seeded from a stable hash of what identifies them (operator and case), never from
the order tests run in, so every worker and every run draws the same values, in every dtype.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from numalign.session.option_values import TIERS

if TYPE_CHECKING:
    import torch

#: Value regimes: how inputs are drawn.
REGIMES: Mapping[str, str] = {
    "ordinary": "standard normal values",
    "large": "standard normal times 100: softmax logits of 100 and more, overflow-prone sums",
    "small": "standard normal times 1e-2: mean square near 1e-4, where epsilon matters",
    "outliers": "standard normal with a few channels 50x larger, as in real hidden states",
    "ties": "values from a handful of levels, so that selections tie exactly",
}

#: Scale of each regime over a standard normal.
_REGIME_SCALE = {"ordinary": 1.0, "large": 100.0, "small": 1e-2, "outliers": 1.0, "ties": 1.0}
#: Every 97th channel (a prime, so it is unaligned) carries the outliers, 50x larger: real
#: checkpoints show a few hidden channels one to two orders above the rest.
_OUTLIER_STRIDE, _OUTLIER_SCALE = 97, 50.0
#: Levels for the ties regime: few enough that rows of 8 or more values repeat some.
_TIE_LEVELS = 5
#: Tensor- and vocabulary-parallel ranks a table of V rows is split over: rank r of k holds
#: the rows from r * (V // k) (an even split) or r * ceil(V / k) (Megatron's padded ranks,
#: torch.chunk) on; a shard range test off by one reads the id at a boundary from the wrong
#: shard, and only that id.
SHARD_COUNTS = (2, 4, 8)
#: The first id past 16 bits: a kernel that keeps ids in 16 bits wraps it to row 0.
ID16_LIMIT = 65536


@dataclass(frozen=True)
class Case:
    """One point of an operator's grid: a readable name, its parameters, its value regime,
    and the lowest tier it runs at (smoke cases run at every tier)."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    regime: str = "ordinary"
    tier: str = "smoke"

    def __post_init__(self) -> None:
        if self.regime not in REGIMES:
            raise ValueError(f"case {self.name}: unknown regime {self.regime!r}; {list(REGIMES)}")
        if self.tier not in TIERS:
            raise ValueError(f"case {self.name}: unknown tier {self.tier!r}; {list(TIERS)}")

    def runs_at(self, tier: str) -> bool:
        return TIERS.index(self.tier) <= TIERS.index(tier)

    def __getitem__(self, key: str) -> Any:
        return self.params[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from a stable hash of ``parts`` (independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(*parts: object) -> torch.Generator:
    """A CPU torch.Generator seeded by ``stable_seed(*parts)``."""
    import torch

    return torch.Generator().manual_seed(stable_seed(*parts))


def values(
    shape: Sequence[int],
    regime: str,
    gen: torch.Generator,
    *,
    channel_dim: int = -1,
) -> torch.Tensor:
    """Float64 values of ``shape`` drawn for ``regime`` (see ``REGIMES``)."""
    import torch

    x = torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * _REGIME_SCALE[regime]
    if regime == "outliers" and x.dim() and x.shape[channel_dim] > 1:
        index = torch.arange(0, x.shape[channel_dim], _OUTLIER_STRIDE)
        x.index_fill_(channel_dim % x.dim(), index, 0.0)
        x += torch.zeros_like(x).index_fill_(channel_dim % x.dim(), index, 1.0) * (
            _OUTLIER_SCALE * torch.randn(tuple(shape), generator=gen, dtype=torch.float64)
        )
    elif regime == "ties":
        # Multiples of 1/4: exact in every dtype, so ties survive the cast.
        x = torch.randint(0, _TIE_LEVELS, tuple(shape), generator=gen).to(torch.float64) / 4
    return x


def boundary_ids(size: int) -> list[int]:
    """The ids of a table of ``size`` rows where kernels split it, most telling first: the
    last id before and the first id of the second half (two shards), the first and last rows,
    ``ID16_LIMIT`` - 1, ``ID16_LIMIT`` and ``ID16_LIMIT`` + 1 where the table is larger, then
    both sides of every rank boundary of 4 and 8 shards (``SHARD_COUNTS``), even and padded
    splits. Unique, each in [0, size)."""
    halves = [size // 2 - 1, size // 2, -(-size // 2) - 1, -(-size // 2)]
    ordered = [*halves, 0, size - 1, ID16_LIMIT - 1, ID16_LIMIT, ID16_LIMIT + 1]
    for k in SHARD_COUNTS[1:]:
        for rank in range(1, k):
            for start in (rank * (size // k), rank * -(-size // k)):
                ordered += [start - 1, start]
    return [i for n, i in enumerate(ordered) if 0 <= i < size and i not in ordered[:n]]


def table_ids(size: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` int64 ids into a table of ``size`` rows (an embedding's token ids, a loss's
    labels): the table's ``boundary_ids`` first, as many as fit, the rest drawn uniformly
    (seeded by ``gen``). An input that indexes a table of V rows takes its ids from here, so
    that every case at every tier holds the ids that shard boundaries split."""
    import torch

    ids = torch.randint(0, max(size, 1), (count,), generator=gen)
    fixed = boundary_ids(size)[:count]
    ids[: len(fixed)] = torch.tensor(fixed, dtype=torch.int64)
    return ids


def noncontiguous(x: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (every other element of a wider buffer)."""
    import torch

    if x.dim() == 0 or x.numel() == 0:
        return x
    wide = torch.empty((*x.shape[:-1], 2 * x.shape[-1]), dtype=x.dtype, device=x.device)
    view = wide[..., ::2]
    view.copy_(x)
    return view
