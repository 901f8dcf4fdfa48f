"""The sweep's planted bug: norms 2% too large (RMSNorm and LayerNorm), swapped into a swept
model with ``--candidates numalign.sweep.planted --swap rms_norm=sweep_scaled_2pct``. Imported
only by the sweep's planted replay, so no other session's catalogue holds them."""

from __future__ import annotations

from typing import Any

import torch

import numalign

#: How much too large the planted norms' outputs are: within bfloat16's max-abs budget at
#: most elements, a systematic scale all the same (the class of bug a fused kernel with a
#: wrong reduction length makes).
PLANTED_SCALE = 1.02


@numalign.candidate("rms_norm", name="sweep_scaled_2pct")
def rms_norm_scaled(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> Any:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (offset + weight.float()) * PLANTED_SCALE).to(x.dtype)


@numalign.candidate("layer_norm", name="sweep_scaled_2pct")
def layer_norm_scaled(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> Any:
    xf = x.float()
    out = torch.nn.functional.layer_norm(
        xf, (x.shape[-1],), None if weight is None else weight.float(), None, eps
    )
    out = out * PLANTED_SCALE
    return (out if bias is None else out + bias.float()).to(x.dtype)
