"""A tensor a golden set keeps as statistics only (format ``numalign.golden/5``), as its
manifest records it: ``StatisticsInfo``, and its conversion to and from the statistics the
judge reads (``core.statistics.TensorStatistics``)."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from numalign.core.errors import Unsupported
from numalign.core.statistics import DEFAULT_WIDTH, ExactStatistics, TensorStatistics

if TYPE_CHECKING:
    import torch

#: The format of a set that keeps some tensors as statistics only (``Manifest.statistics``);
#: a set without them is written as format 4, which numalign before it reads.
STATISTICS_FORMAT = "numalign.golden/5"
#: The suffix of a kept tensor's sketch among the set's tensors (its key plus this).
SKETCH_SUFFIX = "#sketch"


@dataclass(frozen=True)
class KeptWhole:
    """Which tensors a capture keeps whole: every one where ``patterns`` is None (the
    default); else the tensors of the points whose names match one of ``patterns``
    (fnmatch), and of every other point only what is no larger than its statistics (at
    most twice ``width`` elements) or not a floating tensor (masks, indices, routing). The
    rest are kept as statistics with sketches of ``width`` buckets (``core.statistics``)."""

    patterns: tuple[str, ...] | None = None
    width: int = DEFAULT_WIDTH

    @classmethod
    def of(cls, patterns: Sequence[str] | None, width: int = DEFAULT_WIDTH) -> KeptWhole:
        if width < 1:
            raise ValueError(f"--sketch-width {width}: a number of buckets, 1 or more")
        return cls(None if patterns is None else tuple(patterns), width)

    def whole(self, point: str) -> bool:
        """Whether ``point``'s tensors are all kept whole."""
        if self.patterns is None:
            return True
        return any(fnmatch.fnmatchcase(point, p) for p in self.patterns)

    def small(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is kept whole at any point: no larger than its statistics, or
        not floating."""
        return not tensor.is_floating_point() or tensor.numel() <= 2 * self.width


class StatisticsOnly(Unsupported, LookupError):
    """A tensor the set keeps as statistics only, asked for whole: what needs it (a point run
    alone on it as an input, an engine that pairs tensors itself) is skipped with why."""

    def __init__(self, where: str, key: str) -> None:
        super().__init__(
            f"{where}: {key!r} is kept as statistics only (the set was captured with "
            "--full-points, and no full point holds it): what needs the tensor itself (a "
            "point run alone on it, an engine that reads it whole) is not replayed; the whole "
            "model judges its point by its statistics. Capture again with --full-points "
            "matching its point to keep it whole"
        )
        self.key = key


@dataclass(frozen=True, kw_only=True)
class StatisticsInfo(ExactStatistics):
    """A tensor kept as statistics only: its shape and dtype at the positions a request's
    mask keeps, its exact statistics, and the key of its sketch among the set's tensors
    (verified by the shards' sha256 like any tensor)."""

    shape: list[int]
    dtype: str
    sketch: str

    @classmethod
    def of(cls, stats: TensorStatistics, sketch_key: str) -> StatisticsInfo:
        return cls(shape=list(stats.shape), dtype=stats.dtype, sketch=sketch_key,
                   **stats.scalars())  # fmt: skip

    def statistics(self, sketch: torch.Tensor) -> TensorStatistics:
        """The statistics the judge reads, with the sketch loaded from the set."""
        return TensorStatistics(shape=tuple(self.shape), dtype=self.dtype, sketch=sketch,
                                **self.scalars())  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


def statistics_summary(statistics: dict[str, StatisticsInfo], sketch_bytes: int) -> str | None:
    """What a set keeps as statistics only (``statistics``, its sketches ``sketch_bytes``)
    against what those tensors would take whole; None where it keeps every tensor whole."""
    import torch

    if not statistics:
        return None
    whole = sum(math.prod(s.shape) * torch.empty((), dtype=getattr(torch, s.dtype))
                .element_size() for s in statistics.values())  # fmt: skip
    return (
        f"{len(statistics)} tensors kept as statistics only, their sketches "
        f"{sketch_bytes / 1e6:.2f} MB where whole they would take {whole / 1e6:.2f} MB"
    )
