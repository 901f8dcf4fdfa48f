"""A candidate kernel's known systematic scale, as an engine measured it directly: the data an
engine hands the judge beside its observations (``compare.known_scale`` judges with it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KnownScale:
    """A kernel that scales its outputs by a factor in [``low``, ``high``] (measured on the
    probe's inputs; below 1 shrinks), at ``points`` (the capture points whose output the
    kernel produces, whole: a decoder layer that adds the residual to it is not one), with
    ``evidence``: what was measured, how, and where it is written up."""

    points: frozenset[str]
    low: float
    high: float
    evidence: str

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high:
            raise ValueError(f"a known scale needs 0 < low <= high, not {self.low}, {self.high}")

    def scales(self) -> tuple[float, ...]:
        """The scales a failure is judged again with: the range's ends and middle."""
        middle = (self.low + self.high) / 2
        return tuple(dict.fromkeys((self.low, middle, self.high)))

    def removed(self, actual: torch.Tensor, scale: float, *, rounded: bool = True) -> torch.Tensor:
        """``actual`` with ``scale`` taken out, in float64, then (``rounded``) rounded to
        nearest in its own dtype, as an honest kernel's output would be."""
        undone = actual.double() / scale
        return undone.to(actual.dtype) if rounded else undone
