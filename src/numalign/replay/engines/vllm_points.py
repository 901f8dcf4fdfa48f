"""How vLLM's model code maps onto a golden set's capture points, for every architecture
vLLM serves: modules by name (vLLM keeps transformers' module names for the blocks numalign
captures: ``model.embed_tokens``, ``model.layers.N`` with ``self_attn``, ``mlp``, its norms,
``model.norm``), checked by output shape; a small table renames the few blocks vLLM names
otherwise; and one rule reads the reference's output out of vLLM's dual residual stream.

vLLM carries the residual stream as a second tensor: a decoder layer returns ``(hidden,
residual)``, whose sum is the reference's layer output, and a norm given a residual fuses
the add and returns ``(normed, residual)``, whose first part is the reference's norm output.
That residual is the stream entering the norm, which is the reference norm's own input
(transformers' norms take the stream itself): it is judged as the norm's output ``residual``
against the golden input, so a fused add that returns the wrong stream fails at its norm.
A point vLLM has no module for (the fused ``qkv_proj`` and ``gate_up_proj`` replace
transformers' separate projections) is reported unmapped with the reason, never dropped.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from numalign.golden.manifest import LOGIT_TRANSFORM
from numalign.golden.mask_points import MASK_FUNCTION

#: Where vLLM's model names a captured block otherwise than transformers does, per
#: architecture: the point's last name -> vLLM's (every entry has a test).
RENAMES: dict[str, dict[str, str]] = {
    "MixtralForCausalLM": {"mlp": "block_sparse_moe"},
}
#: The output path of the residual stream a fused add + norm returns beside its normed output.
RESIDUAL = "residual"
#: The point of the LM head: vLLM never calls its ``lm_head`` module (its logits processor
#: applies the head's weight), so the point is read from the engine's logits computation.
LM_HEAD = "lm_head"


@dataclass(frozen=True)
class PointMap:
    """A golden point and the vLLM module whose output stands for it (None: unmapped, with
    the reason)."""

    point: str
    module: str | None
    reason: str | None = None


def map_points(
    architecture: str,
    points: Iterable[str],
    modules: Mapping[str, str],
    config: Any = None,
    routers: Collection[str] = (),
) -> list[PointMap]:
    """Each golden point's vLLM module (``modules``: vLLM's module names -> class names),
    by name after ``RENAMES``; the LM head from the engine's logits where the model applies
    no transform after its head (a final soft-capping changes them). ``routers``: the
    points that are MoE routers (their outputs hold a routing, ``golden.routing``)."""
    renames = RENAMES.get(architecture, {})
    out = []
    for point in points:
        if point == LM_HEAD:
            capping = getattr(config, "final_logit_softcapping", None) if config else None
            if capping:
                out.append(PointMap(point, None, (
                    f"vLLM's logits include the final soft-capping ({capping}); the reference's "
                    "lm_head point is before it (the logits are judged after it)"
                )))  # fmt: skip
            else:
                out.append(PointMap(point, LM_HEAD))
            continue
        if point == LOGIT_TRANSFORM:
            out.append(PointMap(point, None, (
                "vLLM applies the logit transform inside its logits processor, with the head: "
                "judged in the logits"
            )))  # fmt: skip
            continue
        if point in routers:
            out.append(PointMap(point, None, (
                "vLLM's router is a linear layer giving the router logits; its fused MoE "
                "kernel chooses and weighs the experts inside: the routing is judged in the "
                "MoE block's output"
            )))  # fmt: skip
            continue
        parent, _, last = point.rpartition(".")
        name = f"{parent}.{renames[last]}" if last in renames and parent else point
        if MASK_FUNCTION.match(last) and name not in modules:
            out.append(PointMap(point, None, (
                f"vLLM builds no mask ({last} is transformers' own): its attention backends "
                "take each sequence's length and positions in their metadata"
            )))  # fmt: skip
        elif name in modules and modules[name].endswith("AndMul"):
            # vLLM's SiluAndMul / GeluAndMul take gate and up side by side and multiply them:
            # no module of it computes the reference's activation alone (its probe's point)
            out.append(PointMap(point, None, (
                f"vLLM's {name} is a fused {modules[name]} (the activation times the up "
                "projection, on both side by side): the activation alone is not its output"
            )))  # fmt: skip
        elif name in modules:
            out.append(PointMap(point, name))
        else:
            siblings = sorted(
                m.rpartition(".")[2] for m in modules if m.rpartition(".")[0] == parent
            )
            out.append(PointMap(point, None, (
                f"vLLM's {architecture} has no module {name}"
                + (f" (beside it: {', '.join(siblings)})" if siblings else "")
            )))  # fmt: skip
    return out


def reference_output(module: Any, output: Any) -> Any:
    """The tensor of vLLM's ``output`` that the reference's point output is: a tensor as it
    is; a norm's ``(normed, residual)`` its first part; a block's ``(hidden, residual)`` of
    one shape their sum (the residual stream the reference's block returns); any other tuple
    its first tensor."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    tensors = (
        [o for o in output if isinstance(o, torch.Tensor)]
        if isinstance(output, (tuple, list))
        else []
    )
    if not tensors:
        return None
    if "norm" in type(module).__name__.lower():
        return tensors[0]
    if len(tensors) == 2 and tensors[0].shape == tensors[1].shape:
        return tensors[0] + tensors[1]
    return tensors[0]


def residual_output(module: Any, output: Any) -> Any:
    """The residual stream a fused add + norm returns as the second part of ``(normed,
    residual)``; None for anything else."""
    import torch

    if "norm" not in type(module).__name__.lower() or not isinstance(output, (tuple, list)):
        return None
    if len(output) == 2 and all(isinstance(o, torch.Tensor) for o in output):
        return output[1]
    return None
