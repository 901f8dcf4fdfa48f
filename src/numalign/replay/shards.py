"""Whole tensors from a tensor-parallel rank's shards, for comparison with golden ones.

Under transformers' ``tp_plan`` most module outputs are whole on every rank (a row-parallel
projection all-reduces its partial sums), but some are this rank's shard: eager attention
weights (a rank's heads), a column-parallel output, a KV cache (a rank's key/value heads).
``whole`` gathers such a shard from every rank along the one dimension where the rank's size
times the number of ranks is the golden size (column-parallel shards are contiguous, in rank
order). Every rank compares the same tensors in the same order, so the gathers (collectives)
line up across ranks.

A row-parallel projection's output is the sum of the ranks' partial sums, each already
rounded to the dtype; where the output is smaller than one rounding of the partials, the sum
lands exactly on zero (a + b == 0 in bfloat16). Such zeros are chance, not a flushed tile:
``split_reduction_zeros`` is the fraction of values where the distribution rule expects them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from numalign.compare.metrics import ControlErrors


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


def split_reduction_zeros(
    errors: ControlErrors, expected: torch.Tensor, dtype: str
) -> ControlErrors:
    """``errors`` (a control's), expecting exact zeros wherever the reference lies within
    one rounding (ulp in ``dtype``) of the output's largest magnitude, the scale of the
    ranks' partial sums, when this process is one of several tensor-parallel ranks; outside
    a group, ``errors`` unchanged."""
    import dataclasses
    import math

    from numalign.compare.tolerances import FLOAT_FORMATS

    if dtype not in FLOAT_FORMATS or not _in_group() or not expected.numel():
        return errors
    largest = float(expected.abs().max())
    if largest == 0:
        return errors
    ulp = 2.0 ** (math.floor(math.log2(largest)) - FLOAT_FORMATS[dtype][0])
    fraction = float((expected.abs() <= ulp).sum()) / expected.numel()
    return dataclasses.replace(errors, zero_fraction=max(errors.zero_fraction or 0.0, fraction))


def _in_group() -> bool:
    import torch

    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )
