"""Tiles for the candidates that emulate tiled kernels: every tile at once, no Python loop.

A kernel walks its tiles in a loop; a candidate that loops in Python over ``range(0, n, TILE)``
makes ``torch.compile`` unroll that loop once for every length it meets (tens of seconds a case
for the catalogue's long rows). These helpers cut a dimension into tiles as a view plus padding,
so a candidate computes every tile's partial result in one batched operation and then reduces
over the tile dimension: one graph for every length, and the per-tile rounding a tiled kernel
has (each tile's partial product, each tile's softmax against its own max) kept.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def tiles(x: torch.Tensor, size: int, dim: int = -1, fill: float | bool = 0.0) -> torch.Tensor:
    """``x`` with ``dim`` cut into tiles of ``size``: that dim becomes ``(n_tiles, size)``,
    the last tile padded with ``fill`` (0 for sums, -inf for maxima, False for masks)."""
    dim = dim % x.dim()
    length = x.shape[dim]
    pad = (-length) % size
    # F.pad lists (before, after) pairs from the last dim backwards
    x = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, pad], value=fill)
    return x.unflatten(dim, ((length + pad) // size, size))


def untile(x: torch.Tensor, length: int, dim: int = -2) -> torch.Tensor:
    """The inverse of :func:`tiles`: dims ``dim`` and ``dim + 1`` merged, padding cut off."""
    dim = dim % x.dim()
    return x.flatten(dim, dim + 1).narrow(dim, 0, length)


def tile_products(x: torch.Tensor, w: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` [m, k] times ``w`` [n, k] transposed, one product per tile of ``size`` along K:
    [k tiles, m, n], to be scaled and summed as a split-K or block-scaled kernel does."""
    return tiles(x, size).transpose(0, 1) @ tiles(w, size).permute(1, 2, 0)


def split_softmax(
    scores: torch.Tensor,
    tile: int,
    *,
    sink: torch.Tensor | None = None,
    p_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split-KV softmax of flash-decoding over the last dim of ``scores`` (float32 or
    float64; masked entries -inf).

    Each tile of ``tile`` scores takes its exponentials against its own max and sums them;
    tiles merge by rescaling with ``exp(tile max - overall max)``, the merge the online
    softmax makes one tile at a time. ``p_dtype`` rounds the exponentials (not the sums)
    before they weigh values, as fused kernels round P before the PV product; ``sink`` ([...,
    1], broadcastable) is an extra logit with no value that joins the max and the sum.

    Returns ``(weights, total, peak)``: ``weights`` [..., s] the rescaled exponentials,
    ``total`` [..., 1] their merged sum and ``peak`` [..., 1] the overall max (0 where every
    score is -inf), so that softmax = weights / total (0 where total is 0), ``weights @ v``
    the unnormalised output and logsumexp = peak + log(total).
    """
    length = scores.shape[-1]
    blocks = tiles(scores, tile, fill=-math.inf)  # [..., n, tile]
    tile_max = blocks.amax(-1, keepdim=True)  # [..., n, 1]
    peak = tile_max.amax(-2)  # [..., 1]
    if sink is not None:
        peak = torch.maximum(peak, sink.to(peak.dtype))
    peak = peak.nan_to_num(0.0, neginf=0.0)
    tile_safe = tile_max.nan_to_num(0.0, neginf=0.0)
    p = torch.exp(blocks - tile_safe)
    tile_sum = p.sum(-1, keepdim=True)
    # a tile with no finite score has tile_max -inf: its rescale is exp(-inf) = 0
    rescale = torch.exp(tile_max - peak[..., None, :])
    total = (tile_sum * rescale).sum(-2)
    if sink is not None:
        total = total + torch.exp(sink.to(peak.dtype) - peak)
    if p_dtype is not None:
        p = p.to(p_dtype).to(scores.dtype)
    return untile(p * rescale, length), total, peak
