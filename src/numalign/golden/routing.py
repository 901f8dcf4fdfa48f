"""A router's outputs as numalign stores and judges them: the combine weights per expert.

transformers' MoE routers (``MixtralTopKRouter``, ``DeepseekV3TopkRouter``, and the other
``...Router`` classes of transformers 5) return the router logits [tokens, experts], the
chosen experts' weights [tokens, k] and their indices [tokens, k]. The slots' order is the
kernel's (DeepSeek-V3 takes its top-k with ``sorted=False``), and where two experts nearly
tie an honest lower-precision run may choose the other one: per slot, one such token would
move a whole weight and swamp any budget. So a point's output of that form is kept as the
logits (path ``0``) and the **routing** (path ``ROUTING``): the weight each expert gets,
[tokens, experts], zero where it is not chosen. ``compare.routing`` judges it: the tokens
whose chosen experts agree by their weights, the others by their count against the honest
ensemble's.

Every place that takes a capture point's tensor outputs (the capture, layer and whole-model
replay, calibration) takes them through ``point_tensors``, so a router is stored, replayed
and calibrated in the one form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from numalign.compare.routing import ROUTING as ROUTING  # the path, as the format names it
from numalign.golden.reference import flatten

if TYPE_CHECKING:
    import torch


def point_tensors(output: Any) -> list[tuple[str, torch.Tensor]]:
    """A capture point's tensor outputs by path (``reference.flatten``), a router's
    (logits, top-k weights, top-k indices) as the logits and its routing (``routing``)."""
    import torch

    tensors = [(p, t) for p, t in flatten(output) if isinstance(t, torch.Tensor)]
    if [p for p, _ in tensors] != ["0", "1", "2"]:  # a router returns a triple
        return tensors
    routing = routing_of([t for _, t in tensors])
    return tensors if routing is None else [("0", tensors[0][1]), (ROUTING, routing)]


def routing_of(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The weight each expert gets, [..., experts], where ``tensors`` are a router's
    (logits [..., experts], weights [..., k], indices [..., k]) with k below the experts'
    count; None for anything else."""
    if len(tensors) != 3:
        return None
    logits, weights, indices = tensors
    if not (
        logits.is_floating_point()
        and weights.is_floating_point()
        and not indices.is_floating_point()
        and weights.shape == indices.shape
        and weights.dim() >= 1
        and logits.shape[:-1] == weights.shape[:-1]
        and 0 < weights.shape[-1] < logits.shape[-1]
    ):
        return None
    dense = weights.new_zeros(logits.shape)
    return dense.scatter(-1, indices.long(), weights)
