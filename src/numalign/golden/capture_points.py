"""Which modules a capture records: the default capture points of a model
(``default_points``), or the modules that match the patterns asked for (``select_points``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Module class names that are capture points inside a block.
_BLOCK_PARTS = re.compile(
    r"(Attention|Attn|MLP|Mlp|MoE|Moe|MoeBlock|Experts|GatedDeltaNet|Norm|LayerNorm"
    r"|Intermediate|Output)$"  # an encoder layer's feed-forward halves (BERT)
)
_SKIP_TYPES = re.compile(r"(RotaryEmbedding|Dropout|Activation|ModuleList|ModuleDict|Identity)$")
#: The model's position-embedding modules (rotary cos/sin computed once per forward and fed
#: to every attention): capture points outside the blocks, so a fault in what the attention is
#: fed is judged where it is made.
_POSITION_TYPES = re.compile(r"RotaryEmbedding$")
#: An MoE block's router (transformers 5's ``...TopKRouter``, remote code's ``MoEGate``):
#: a capture point inside the block, so that what it chooses and weighs is judged where it
#: is computed (``golden.routing``).
ROUTER_TYPES = re.compile(r"(Router|MoEGate)$")


def default_points(model: torch.nn.Module) -> list[str]:
    """Embeddings, the masks (``golden.mask_points``) and position embeddings (rotary
    cos/sin) the model computes outside its blocks, every block (decoder or vision) with its
    attention, MLP or MoE (and the MoE's router, ``golden.routing``) and norms, the final
    norm, the LM head and the logit transform after it (``golden.logit_transform``, where
    the model has one), and the vision patch embedding and merger."""
    import torch

    from numalign.golden.logit_transform import LogitTransform
    from numalign.golden.mask_points import MaskFunction

    blocks = {
        name
        for name, module in model.named_modules()
        if name.rpartition(".")[2].isdigit()
        and isinstance(model.get_submodule(name.rpartition(".")[0]), torch.nn.ModuleList)
        and not _SKIP_TYPES.search(type(module).__name__)
    }

    def in_block(name: str) -> bool:
        return any(name.startswith(b + ".") for b in blocks)

    def wanted(name: str, module: torch.nn.Module) -> bool:
        kind = type(module).__name__
        if isinstance(module, MaskFunction):  # a mask the model builds, where it calls one
            return True
        if isinstance(module, LogitTransform):  # after the head, where the model does something
            return module.changes_logits()
        if name and _POSITION_TYPES.search(kind):
            return not in_block(name) and ".visual" not in name
        if not name or _SKIP_TYPES.search(kind):
            return False
        if name in blocks or name == "lm_head" or name.endswith((".merger", ".patch_embed")):
            return True
        if name.rpartition(".")[0] in blocks:  # a block's attention, MLP, MoE or norm
            return bool(_BLOCK_PARTS.search(kind))
        if ROUTER_TYPES.search(kind):  # an MoE block's router
            return in_block(name)
        if isinstance(module, torch.nn.Embedding):
            return not in_block(name)
        # the final norm: outside every block and outside the vision tower
        return (
            kind.endswith("Norm")
            and not in_block(name)
            and ".visual" not in name
            and "merger" not in name
        )

    return [name for name, module in model.named_modules() if wanted(name, module)]


def select_points(model: torch.nn.Module, patterns: Sequence[str] | None) -> list[str]:
    """The default points, or the modules whose names match any of ``patterns`` (fnmatch)."""
    if not patterns:
        return default_points(model)
    names = [
        n
        for n, _ in model.named_modules()
        if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)
    ]
    if not names:
        raise ValueError(
            f"--points {list(patterns)} match no module; module names look like "
            f"{[n for n, _ in model.named_modules() if n][:6]}"
        )
    return names
