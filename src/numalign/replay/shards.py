"""Whole tensors from a tensor-parallel rank's shards, for comparison with golden ones.

Under transformers' ``tp_plan`` most module outputs are whole on every rank (a row-parallel
projection all-reduces its partial sums), but some are this rank's shard: eager attention
weights (a rank's heads), a column-parallel output, a KV cache (a rank's key/value heads).
``whole`` gathers such a shard from every rank along the one dimension where the rank's size
times the number of ranks is the golden size (column-parallel shards are contiguous, in rank
order). Every rank compares the same tensors in the same order, so the gathers (collectives)
line up across ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def whole(actual: torch.Tensor, expected_shape: tuple[int, ...]) -> torch.Tensor:
    """``actual`` as a whole tensor of ``expected_shape`` where it is a shard of one; else
    unchanged (a shape that no sharding explains is for the comparison to report)."""
    import torch

    if tuple(actual.shape) == tuple(expected_shape):
        return actual
    from torch.distributed.tensor import DTensor

    if isinstance(actual, DTensor):
        return actual.full_tensor()
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return actual
    ranks = torch.distributed.get_world_size()
    if ranks < 2 or actual.dim() != len(expected_shape):
        return actual
    dims = [
        d
        for d, (mine, theirs) in enumerate(zip(actual.shape, expected_shape, strict=True))
        if mine != theirs
    ]
    if len(dims) != 1 or actual.shape[dims[0]] * ranks != expected_shape[dims[0]]:
        return actual
    local = actual.contiguous()
    if torch.distributed.get_backend() != "gloo" and local.device.type == "cpu":
        # nccl, xccl and hccl gather device tensors only
        accelerator = torch.accelerator.current_accelerator()
        local = local.to(accelerator) if accelerator is not None else local
    parts = [torch.empty_like(local) for _ in range(ranks)]
    torch.distributed.all_gather(parts, local)
    return torch.cat(parts, dim=dims[0]).to(actual.device)
