"""A reference that is not finite is refused: NaN matches NaN, so a golden set holding NaN or
Inf would let any replay pass vacuously. The capture counts the non-finite values of each
point's main output as it records (``count_nonfinite``) and refuses the reference after a
request's forward (``refuse_nonfinite``), naming the first point where they appear.
"""

from __future__ import annotations

from typing import Any

from numalign.core.errors import BrokenData

#: Where a reference first holds NaN or Inf: (request, point, output path, non-finite count,
#: element count).
NonFinite = tuple[str, str, str, int, int]


class NonFiniteReferenceError(BrokenData, ValueError):
    """The reference produced NaN or Inf: a set of it would pass any replay vacuously."""


def count_nonfinite(t: Any, mask: Any = None) -> int:
    """How many values of a floating tensor are NaN or Inf at the positions ``mask`` keeps
    (a [batch, sequence] attention mask, where ``t`` starts with those dimensions; padded
    positions are never compared); 0 for anything else."""
    import torch

    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return 0
    t = t.detach()
    if isinstance(mask, torch.Tensor) and t.dim() >= 2 and t.shape[:2] == mask.shape:
        t = t[mask.to(t.device).bool()]
    return int((~torch.isfinite(t)).sum())


def refuse_nonfinite(
    first: NonFinite | None, request: str, finals: dict[str, Any], mask: Any = None
) -> None:
    """NonFiniteReferenceError naming ``first``, the first capture point (in the order the
    forward ran them) whose outputs hold NaN or Inf, or else the final output of ``request``
    (``finals``, at the positions ``mask`` keeps) that does: NaN matches NaN, so a non-finite
    golden value would make every replay pass."""
    where = first
    if where is None:
        for key, t in finals.items():
            bad = count_nonfinite(t, mask)
            if bad:
                where = (request, f"the model's {key}", "", bad, t.numel())
                break
    if where is None:
        return
    req, point, path, bad, total = where
    output = f" output {path!r}" if path else ""
    raise NonFiniteReferenceError(
        f"the reference is not finite: {point}{output} of request {req} holds {bad} NaN or "
        f"Inf of {total} values, the first capture point where they appear; a golden set of "
        "it would pass any replay (NaN matches NaN). Check the checkpoint's weights for "
        "inf/nan (torch.isfinite), and try another --reference-dtype or --attn-implementation "
        "(eager attention in float64 gives left-padded batches NaN); no set was written"
    )
