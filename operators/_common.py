"""Helpers shared by the operator families."""

from __future__ import annotations

import torch

from numalign.ops.cases import Case


def acc(x: torch.Tensor) -> torch.dtype:
    """The accumulation dtype careful kernels use: float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def up(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its accumulation dtype."""
    return x.to(acc(x))


def divide_or_zero(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``x / total`` where ``total > 0``, else 0: softmax rows with nothing to attend (fully
    masked) are zeros, not NaN."""
    return torch.where(total > 0, x / total.clamp_min(torch.finfo(total.dtype).tiny), 0.0)


def logit_reach(logits: torch.Tensor) -> float:
    """The farthest a softmax's finite logit lies below its row's maximum, over every row
    (``Operator.exponent_reach``); 0 where no row has one."""
    finite = logits.isfinite()
    high = logits.masked_fill(~finite, -torch.inf).amax(-1)
    low = logits.masked_fill(~finite, torch.inf).amin(-1)
    spread = (high - low)[finite.any(-1)]
    return float(spread.max()) if spread.numel() else 0.0


def shape_name(*dims: int) -> str:
    return "x".join(str(d) for d in dims)


def tier_cases(*cases: Case) -> tuple[Case, ...]:
    """A case grid; names must be unique."""
    names = [c.name for c in cases]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"duplicate case names: {sorted(dupes)}")
    return cases
