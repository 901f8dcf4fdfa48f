"""Helpers shared by the operator families."""

from __future__ import annotations

import torch

from numalign.cases import Case


def acc(x: torch.Tensor) -> torch.dtype:
    """The accumulation dtype careful kernels use: float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def up(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its accumulation dtype."""
    return x.to(acc(x))


def shape_name(*dims: int) -> str:
    return "x".join(str(d) for d in dims)


def tier_cases(*cases: Case) -> tuple[Case, ...]:
    """A case grid; names must be unique."""
    names = [c.name for c in cases]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"duplicate case names: {sorted(dupes)}")
    return cases
