"""Mixture of experts: routing (softmax or sigmoid scoring, top-k, renormalisation, grouped
top-k with a correction bias as in DeepSeek-V3) and the expert block (dispatch by gather,
SwiGLU experts, weighted scatter-combine).

Router logits are drawn on separated levels (a permutation of evenly spaced values plus
1e-3 noise), as trained routers spread their logits. The truth sees the logits rounded to the
dtype, so rounding cannot flip a selection; where rounding makes two experts tie exactly,
either may be picked (``experts`` is tie-aware), and with softmax scoring their weights are
equal, with sigmoid scoring the per-expert bias keeps the choice scores apart.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, Output, candidate, register_operator
from operators._common import tier_cases, up

#: DeepSeek-V3's routing: sigmoid scores, top-8 of 8 groups after the best 4 groups,
#: renormalised, scaled by 2.5 (its config's routed_scaling_factor).
DSV3_ROUTING: dict[str, Any] = {
    "top_k": 8, "scoring": "sigmoid", "renormalize": True, "groups": 8, "topk_groups": 4,
    "scaling": 2.5,
}  # fmt: skip

ROUTING_CASES = tier_cases(
    Case(
        "one-1x2-top1",
        {"tokens": 1, "experts": 2, "top_k": 1, "scoring": "softmax", "renormalize": False},
    ),
    Case(
        "mixtral-17x8-top2",
        {"tokens": 17, "experts": 8, "top_k": 2, "scoring": "softmax", "renormalize": True},
    ),
    Case(
        "qwen3-33x128-top8",
        {"tokens": 33, "experts": 128, "top_k": 8, "scoring": "softmax", "renormalize": True},
    ),
    Case("dsv3-9x64-top8-g8", {**DSV3_ROUTING, "tokens": 9, "experts": 64}),
    Case("dsv3-257x256-top8-g8", {**DSV3_ROUTING, "tokens": 257, "experts": 256}, tier="pr"),
    # Trained checkpoints' e_score_correction_bias sits at order 1-10 (the load balancer
    # pushes it far from its zero start): a bias of 5 +- 0.05 makes weights that wrongly
    # include it differ by orders of magnitude more than bfloat16's rounding.
    Case(
        "dsv3-bias5-9x64-top8-g8",
        {**DSV3_ROUTING, "tokens": 9, "experts": 64, "bias": (5.0, 0.05)},
    ),
    Case(
        "dsv3-bias8-257x256-top8-g8",
        {**DSV3_ROUTING, "tokens": 257, "experts": 256, "bias": (8.0, 0.5)},
        tier="pr",
    ),
    Case(
        "softmax-norenorm-100x60-top4",
        {"tokens": 100, "experts": 60, "top_k": 4, "scoring": "softmax", "renormalize": False},
        tier="pr",
    ),
    Case(
        "many-8192x128-top8",
        {"tokens": 8192, "experts": 128, "top_k": 8, "scoring": "softmax", "renormalize": True},
        tier="nightly",
    ),
)

#: Spacing of router logit levels; bfloat16's spacing near 6 is 0.03, well below it.
LEVEL_SPACING = 0.1


#: The correction bias of a freshly initialized DeepSeek-V3 router: near zero (thousandths).
FRESH_BIAS_STEP = 1e-3


def _correction_bias(case: Case, gen: torch.Generator) -> torch.Tensor:
    """DeepSeek-V3's e_score_correction_bias [experts] (real checkpoints keep it in float32;
    the suite rounds it to the target dtype like every floating input): ``bias = (center,
    spread)`` draws center + spread * N(0, 1) per expert; without it, a fresh router's
    thousandths."""
    e = case["experts"]
    if case.get("bias") is None:
        return (torch.arange(e, dtype=torch.float64) % 7) * FRESH_BIAS_STEP
    center, spread = case["bias"]
    return center + spread * torch.randn(e, generator=gen, dtype=torch.float64)


def routing_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    t, e = case["tokens"], case["experts"]
    ranks = torch.argsort(torch.rand(t, e, generator=gen), dim=-1).to(torch.float64)
    logits = (ranks - e / 2) * LEVEL_SPACING * (4.0 / max(e, 4)) ** 0.5
    logits += 1e-3 * torch.randn(t, e, generator=gen, dtype=torch.float64)
    return {
        "logits": logits,
        "bias": _correction_bias(case, gen) if case["scoring"] == "sigmoid" else None,
        "top_k": case["top_k"],
        "scoring": case["scoring"],
        "renormalize": case["renormalize"],
        "groups": case.get("groups", 1),
        "topk_groups": case.get("topk_groups", 1),
        "scaling": case.get("scaling", 1.0),
    }


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    lf = up(logits)
    return torch.softmax(lf, dim=-1) if scoring == "softmax" else torch.sigmoid(lf)


def routing_reference(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    renormalize: bool,
    groups: int,
    topk_groups: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (weights [T, k], experts [T, k], selection scores [T, E]); weights and experts
    are ordered by expert id, so that the order top-k returns them in does not matter."""
    scores = _scores(logits, scoring)
    choice = scores + (bias.to(scores) if bias is not None else 0.0)
    t, e = choice.shape
    if groups > 1:
        per_group = choice.view(t, groups, e // groups)
        group_score = per_group.sort(dim=-1, descending=True).values[..., :2].sum(-1)
        kept_groups = group_score.argsort(dim=-1, descending=True, stable=True)[:, :topk_groups]
        keep = torch.zeros(t, groups, dtype=torch.bool, device=logits.device).scatter_(
            1, kept_groups, True
        )
        choice = choice.masked_fill(~keep.repeat_interleave(e // groups, dim=1), float("-inf"))
    experts = choice.argsort(dim=-1, descending=True, stable=True)[:, :top_k].sort(dim=-1).values
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return (weights * scaling).to(logits.dtype), experts, choice.to(logits.dtype)


register_operator(
    Operator(
        name="moe_routing",
        aten=("topk", "sigmoid"),
        op_class="selection",
        reference=routing_reference,
        make_inputs=routing_inputs,
        cases=ROUTING_CASES,
        outputs=(
            Output("weights"),
            Output("experts", kind="ties", ties_from="choice"),
            Output("choice"),
        ),
        hf_modules=("*TopkRouter", "*TopKRouter", "*MoEGate", "*SparseMoeBlock"),
        description="router scoring, (grouped) top-k, renormalisation and scaling",
    )
)


@candidate("moe_routing", name="topk")
def routing_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    renormalize: bool,
    groups: int,
    topk_groups: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.topk per group and per token; group masks built with scatter."""
    scores = _scores(logits, scoring)
    choice = scores + (bias.to(scores) if bias is not None else 0.0)
    t, e = choice.shape
    if groups > 1:
        group_score = choice.view(t, groups, -1).topk(2, dim=-1).values.sum(-1)
        kept = group_score.topk(topk_groups, dim=-1).indices
        mask = torch.zeros_like(group_score).scatter_(1, kept, 1.0)
        mask = mask[:, :, None].expand(t, groups, e // groups).reshape(t, e)
        choice = choice.masked_fill(mask == 0, float("-inf"))
    experts = choice.topk(top_k, dim=-1).indices.sort(dim=-1).values
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return (weights * scaling).to(logits.dtype), experts, choice.to(logits.dtype)


EXPERT_CASES = tier_cases(
    Case("one-1x1x2-top1", {"tokens": 1, "hidden": 8, "inter": 4, "experts": 2, "top_k": 1}),
    Case(
        "small-17x64x32x8-top2", {"tokens": 17, "hidden": 64, "inter": 32, "experts": 8, "top_k": 2}
    ),
    Case(
        "unbalanced-40x48x24x16-top4",
        {"tokens": 40, "hidden": 48, "inter": 24, "experts": 16, "top_k": 4, "skew": True},
    ),
    Case(
        "outliers-64x256x128x16-top4",
        {"tokens": 64, "hidden": 256, "inter": 128, "experts": 16, "top_k": 4},
        regime="outliers",
        tier="pr",
    ),
    Case(
        "many-512x256x64x64-top8",
        {"tokens": 512, "hidden": 256, "inter": 64, "experts": 64, "top_k": 8},
        tier="nightly",
    ),
)


def expert_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    t, h, f, e, k = case["tokens"], case["hidden"], case["inter"], case["experts"], case["top_k"]
    if case.get("skew"):  # half the tokens go to expert 0; experts e/2 and up get none
        rows = []
        for token in range(t):
            pick = torch.randperm(e // 2, generator=gen)[:k]
            if token < t // 2 and 0 not in pick:
                pick[0] = 0
            rows.append(pick)
        experts = torch.stack(rows)
    else:
        experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    experts = experts.sort(dim=-1).values
    weights = torch.softmax(torch.randn(t, k, generator=gen, dtype=torch.float64), dim=-1)
    return {
        "x": values((t, h), case.regime, gen),
        "experts": experts,
        "weights": weights,
        "w_gate": values((e, f, h), "ordinary", gen) / h**0.5,
        "w_up": values((e, f, h), "ordinary", gen) / h**0.5,
        "w_down": values((e, h, f), "ordinary", gen) / f**0.5,
    }


def _expert(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """SwiGLU expert in float32 with the intermediate stored in the input dtype."""
    hidden = (F.silu(up(x) @ up(w_gate).T) * (up(x) @ up(w_up).T)).to(dtype)
    return up(hidden) @ up(w_down).T


def experts_reference(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Token by token, slot by slot: sum_j weight_j * expert_{e_j}(x_t)."""
    out = torch.zeros(x.shape, dtype=up(x).dtype, device=x.device)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            y = _expert(x[t : t + 1], w_gate[e], w_up[e], w_down[e], x.dtype)
            out[t] += up(weights[t, j]) * y[0]
    return out.to(x.dtype)


register_operator(
    Operator(
        name="moe_experts",
        aten=("index_add",),
        op_class="matmul",
        reference=experts_reference,
        make_inputs=expert_inputs,
        cases=EXPERT_CASES,
        reduction_length=lambda case: case["hidden"],
        hf_modules=("*Experts", "*SparseMoeBlock", "*MoE"),
        description="dispatch tokens to SwiGLU experts, weighted scatter-combine",
    )
)


@candidate("moe_experts", name="grouped")
def experts_grouped(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Sort (token, slot) pairs by expert, gather their rows, one matmul per expert, then a
    weighted index_add back to the tokens (the grouped-GEMM layout of fused MoE kernels)."""
    flat_experts = experts.reshape(-1)
    order = flat_experts.argsort(stable=True)
    tokens = order // experts.shape[1]
    counts = torch.bincount(flat_experts, minlength=w_gate.shape[0]).tolist()
    gathered = x[tokens]
    out = torch.zeros(x.shape, dtype=up(x).dtype, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            y = _expert(gathered[rows], w_gate[e], w_up[e], w_down[e], x.dtype)
            w = up(weights.reshape(-1)[order[rows]])[:, None]
            out.index_add_(0, tokens[rows], w * y)
            start += count
    return out.to(x.dtype)


@candidate("moe_experts", name="dense")
def experts_dense(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Every expert on every token, combined with a dense [T, E] weight matrix."""
    dense = torch.zeros(x.shape[0], w_gate.shape[0], dtype=up(x).dtype, device=x.device)
    dense.scatter_(1, experts, up(weights))
    out = torch.zeros(x.shape, dtype=up(x).dtype, device=x.device)
    for e in range(w_gate.shape[0]):
        out += dense[:, e : e + 1] * _expert(x, w_gate[e], w_up[e], w_down[e], x.dtype)
    return out.to(x.dtype)
