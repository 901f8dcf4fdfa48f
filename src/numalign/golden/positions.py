"""The positions of a request a comparison keeps: what a model computes at padding is not
defined, so neither a capture's statistics nor a replay's comparison reads it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from numalign.core.statistics import Expected
    from numalign.golden.store import GoldenSet


def kept_positions(tensor: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The positions a request's attention mask keeps: what a model computes at padding is
    not defined, so its values are not compared (what is wrong there, a value that is not
    finite, is judged apart: ``left_out``). Outputs laid out [batch, ..., seq, ...] keep the
    positions of the first dimension after the batch that has the sequence's length
    ([batch, seq, hidden]; attention weights [batch, heads, query, key]), and outputs of the
    tokens flattened, [batch * seq, ...] (a router's logits and routing), keep their rows.
    Other layouts, and [batch, features] outputs (an encoder's pooled output), are returned
    whole."""
    laid = by_position(tensor, mask)
    return tensor if laid is None else laid[0][laid[1]]


def by_position(
    tensor: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``tensor`` with a request's positions leading ([batch, seq, ...], or its rows where
    the tokens are flattened) and which of them the mask keeps; None for a layout without
    them (``kept_positions``)."""
    if mask is None:
        return None
    keep = mask.to(tensor.device).bool()
    if tensor.dim() == 2 and tensor.shape[0] == mask.numel() > mask.shape[0]:  # tokens flattened
        return tensor, keep.flatten()
    if tensor.dim() < 3 or tensor.shape[0] != mask.shape[0]:
        return None
    seq_dims = [d for d in range(1, tensor.dim()) if tensor.shape[d] == mask.shape[1]]
    if not seq_dims:
        return None
    return tensor.movedim(seq_dims[0], 1), keep


def expected_at(golden: GoldenSet, key: str, mask: torch.Tensor | None) -> Expected:
    """What ``golden`` keeps of the tensor ``key`` at the positions a request's ``mask``
    keeps: the tensor's kept positions, or its statistics (taken there at capture)."""
    from numalign.core.statistics import TensorStatistics

    found = golden.expected(key)
    return found if isinstance(found, TensorStatistics) else kept_positions(found, mask)
