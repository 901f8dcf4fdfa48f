"""Tensors between the ranks of a pipeline (``replay.pipeline``): point to point and
broadcast, any dtype, with a checksum of their bytes to check on arrival.

A tensor goes as a header (its dtype's index in :data:`WIRE_DTYPES`, its number of
dimensions, :data:`WIRE_DIMS` sizes; int64) and then its bytes (uint8: every backend passes
them, whatever the dtype). :func:`digest` is the sender's checksum of those bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: dtypes a header names, by their index in it.
WIRE_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "bool", "uint8")
#: Dimensions a tensor passed between ranks may have (its header holds the dtype, the
#: number of dimensions and this many sizes).
WIRE_DIMS = 6


def _header(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    if tensor.dim() > WIRE_DIMS:
        raise ValueError(f"a tensor of {tensor.dim()} dimensions cannot pass between ranks")
    dtype = WIRE_DTYPES.index(str(tensor.dtype).removeprefix("torch."))
    sizes = [*tensor.shape, *([0] * (WIRE_DIMS - tensor.dim()))]
    return torch.tensor([dtype, tensor.dim(), *sizes], dtype=torch.int64, device=tensor.device)


def _empty(header: torch.Tensor, device: Any) -> torch.Tensor:
    import torch

    values = [int(v) for v in header.tolist()]
    dtype = getattr(torch, WIRE_DTYPES[values[0]])
    return torch.empty(values[2 : 2 + values[1]], dtype=dtype, device=device)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (any dtype passes through every backend as bytes)."""
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8)


#: Bytes :func:`digest` reads at a time (its int64 working copy is 16 times that).
DIGEST_CHUNK = 1 << 24


def digest(tensor: torch.Tensor) -> torch.Tensor:
    """A checksum of the tensor's bytes, weighted by place (values moved around change it
    too), as a 1-element int64 tensor on its device: each byte times its place modulo the
    largest prime below 2**16, plus one, summed (below 2**63 for up to 2**39 bytes)."""
    import torch

    raw = _bytes(tensor)
    total = torch.zeros(1, dtype=torch.int64, device=raw.device)
    for start in range(0, raw.numel(), DIGEST_CHUNK):
        chunk = raw[start : start + DIGEST_CHUNK].to(torch.int64)
        place = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=raw.device)
        total += (chunk * (place % 65521 + 1)).sum()
    return total


def send_tensor(tensor: torch.Tensor, to: int) -> None:
    """``tensor`` to rank ``to``: its header, then its bytes."""
    import torch.distributed as dist

    dist.send(_header(tensor), to)
    dist.send(_bytes(tensor), to)


def receive_tensor(source: int, device: Any) -> torch.Tensor:
    """The tensor rank ``source`` sends (:func:`send_tensor`), on ``device``."""
    import torch
    import torch.distributed as dist

    header = torch.empty(2 + WIRE_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, source)
    tensor = _empty(header, device)
    dist.recv(_bytes(tensor), source)
    return tensor


def broadcast_tensor(tensor: torch.Tensor | None, source: int, device: Any) -> torch.Tensor:
    """``tensor`` from rank ``source`` on every rank (None on the others)."""
    import torch
    import torch.distributed as dist

    header = _header(tensor) if tensor is not None else torch.empty(
        2 + WIRE_DIMS, dtype=torch.int64, device=device
    )  # fmt: skip
    dist.broadcast(header, source)
    out = tensor.contiguous() if tensor is not None else _empty(header, device)
    dist.broadcast(_bytes(out), source)
    return out
