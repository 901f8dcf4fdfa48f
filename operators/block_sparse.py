"""Block-sparse attention with top-k block selection (NSA / MoBA style).

``block_topk`` scores each key block by the max of q.k within it (causal: only blocks that
start at or before the query), and keeps the top-k blocks per query; the block holding the
query itself is always kept. ``block_sparse_attention`` attends over the kept blocks only,
given the block indices (computed from the truth, so that every candidate attends the same
blocks; the selection is tested on its own, tie-aware)."""

from __future__ import annotations

import math
from typing import Any

import torch

from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, Output, candidate, register_operator
from operators._common import tier_cases, up


def _case(
    name: str,
    heads: int,
    t: int,
    s: int,
    d: int,
    block: int,
    k: int,
    tier: str = "smoke",
    regime: str = "ordinary",
) -> Case:
    params = {"heads": heads, "tokens": t, "keys": s, "dim": d, "block": block, "top_k": k}
    return Case(name, params, regime=regime, tier=tier)


SPARSE_CASES = tier_cases(
    _case("one-block-1x1x1x8-b4-k1", 1, 1, 1, 8, 4, 1),
    _case("small-2x40x40x16-b8-k2", 2, 40, 40, 16, 8, 2),
    _case("ragged-2x70x70x32-b16-k3", 2, 70, 70, 32, 16, 3),
    _case("decode-4x1x1000x64-b64-k4", 4, 1, 1000, 64, 64, 4),
    _case("large-2x128x128x32-b32-k2", 2, 128, 128, 32, 32, 2, regime="large", tier="pr"),
    _case("llm-4x512x512x128-b64-k4", 4, 512, 512, 128, 64, 4, tier="pr"),
    _case("long-1x64x32768x64-b64-k16", 1, 64, 32768, 64, 64, 16, tier="nightly"),
)


def sparse_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    h, t, s, d = case["heads"], case["tokens"], case["keys"], case["dim"]
    q = values((h, t, d), case.regime, gen)
    k = values((h, s, d), "ordinary", gen)
    inputs = {"q": q, "k": k, "block": case["block"], "top_k": case["top_k"]}
    return inputs


def _block_scores(q: torch.Tensor, k: torch.Tensor, block: int) -> torch.Tensor:
    """[heads, tokens, blocks]: max over each key block of q.k, -inf for blocks that start
    after the query (queries are the last ``tokens`` of ``keys``)."""
    h, t, _ = q.shape
    s = k.shape[1]
    blocks = math.ceil(s / block)
    scores = up(q) @ up(k).transpose(-1, -2) * q.shape[-1] ** -0.5
    q_pos = torch.arange(s - t, s, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(s, device=q.device)[None, :] > q_pos, -math.inf)
    padded = torch.nn.functional.pad(scores, (0, blocks * block - s), value=-math.inf)
    return padded.view(h, t, blocks, block).amax(-1)


def block_topk_reference(
    q: torch.Tensor, k: torch.Tensor, block: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept block indices [heads, tokens, k'], block scores [heads, tokens, blocks]) with
    k' = min(top_k, blocks); the query's own block gets +inf so it is always kept."""
    scores = _block_scores(q, k, block)
    t, s = q.shape[1], k.shape[1]
    own = (torch.arange(s - t, s, device=q.device) // block)[None, :, None]
    ranked = scores.scatter(-1, own.expand(scores.shape[0], -1, 1), math.inf)
    kept = min(top_k, scores.shape[-1])
    order = torch.argsort(ranked, dim=-1, descending=True, stable=True)[..., :kept]
    return order.sort(dim=-1).values, ranked.to(q.dtype)


register_operator(
    Operator(
        name="block_topk",
        op_class="selection",
        reference=block_topk_reference,
        make_inputs=sparse_inputs,
        cases=SPARSE_CASES,
        outputs=(Output("blocks", kind="ties", ties_from="scores"), Output("scores")),
        description="score key blocks by max q.k, keep the top-k per query",
    )
)


@candidate("block_topk", name="topk")
def block_topk_torch(
    q: torch.Tensor, k: torch.Tensor, block: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scores by a strided max-pool of the score matrix, then torch.topk."""
    t, s = q.shape[1], k.shape[1]
    scores = up(q) @ up(k).transpose(-1, -2) * q.shape[-1] ** -0.5
    causal = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    scores = scores.masked_fill(~causal, -math.inf)
    pooled = torch.nn.functional.max_pool1d(
        scores.flatten(0, 1)[:, None], kernel_size=block, stride=block, ceil_mode=True
    ).view(q.shape[0], t, -1)
    own = torch.arange(s - t, s, device=q.device) // block
    pooled[:, torch.arange(t, device=q.device), own] = math.inf
    kept = min(top_k, pooled.shape[-1])
    blocks = pooled.topk(kept, dim=-1).indices.sort(dim=-1).values
    return blocks, pooled.to(q.dtype)


SPARSE_ATTN_CASES = SPARSE_CASES


def sparse_attention_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    inputs = sparse_inputs(case, gen)
    inputs["v"] = values(inputs["k"].shape, "ordinary", gen)
    blocks, _ = block_topk_reference(inputs["q"], inputs["k"], case["block"], case["top_k"])
    inputs["blocks"] = blocks
    del inputs["top_k"]
    return inputs


def sparse_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, block: int
) -> torch.Tensor:
    """Per query: gather the keys of its kept blocks, causal-mask them, softmax, weight v."""
    h, t, d = q.shape
    s = k.shape[1]
    offsets = torch.arange(block, device=q.device)
    key_idx = (blocks[..., None] * block + offsets).flatten(-2)  # [h, t, k'*block]
    q_pos = torch.arange(s - t, s, device=q.device)[None, :, None]
    valid = (key_idx < s) & (key_idx <= q_pos)
    key_idx = key_idx.clamp_max(s - 1)
    kf = up(k).gather(1, key_idx.reshape(h, -1, 1).expand(-1, -1, d)).view(h, t, -1, d)
    vf = up(v).gather(1, key_idx.reshape(h, -1, 1).expand(-1, -1, d)).view(h, t, -1, d)
    scores = torch.einsum("htd,htkd->htk", up(q), kf) * d**-0.5
    probs = torch.softmax(scores.masked_fill(~valid, -math.inf), dim=-1)
    return torch.einsum("htk,htkd->htd", probs, vf).to(q.dtype)


register_operator(
    Operator(
        name="block_sparse_attention",
        op_class="attention",
        reference=sparse_attention_reference,
        make_inputs=sparse_attention_inputs,
        cases=SPARSE_ATTN_CASES,
        reduction_length=lambda case: case["block"] * case["top_k"],
        description="attention over the kept key blocks only",
    )
)

#: Keys up to which the masked-dense candidate runs: beyond it the dense score matrix costs
#: more memory than the case is worth (it is O(tokens x keys)).
DENSE_LIMIT = 8192


def _dense_supports(case: Case) -> str | None:
    if case["tokens"] * case["keys"] > DENSE_LIMIT * DENSE_LIMIT // 16:
        return f"masked dense is O(tokens x keys); skipped above {DENSE_LIMIT**2 // 16} scores"
    return None


@candidate("block_sparse_attention", name="masked_dense", supports=_dense_supports)
def sparse_attention_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, block: int
) -> torch.Tensor:
    """Dense scores with every key outside the kept blocks masked."""
    h, t, d = q.shape
    s = k.shape[1]
    key_block = torch.arange(s, device=q.device) // block
    kept = torch.zeros(h, t, math.ceil(s / block), dtype=torch.bool, device=q.device)
    kept.scatter_(-1, blocks, True)
    mask = kept[..., key_block] & torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    scores = (up(q) @ up(k).transpose(-1, -2) * d**-0.5).masked_fill(~mask, -math.inf)
    return (torch.softmax(scores, dim=-1) @ up(v)).to(q.dtype)


@candidate("block_sparse_attention", name="gather_online")
def sparse_attention_online(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, block: int
) -> torch.Tensor:
    """Kept blocks gathered one at a time with an online softmax in float32 (the NSA
    selected-attention kernel's loop)."""
    h, t, d = q.shape
    s = k.shape[1]
    qf = up(q) * d**-0.5
    q_pos = torch.arange(s - t, s, device=q.device)[None, :, None]
    run_max = torch.full((h, t, 1), -math.inf, dtype=qf.dtype, device=q.device)
    run_sum = torch.zeros_like(run_max)
    acc = torch.zeros(h, t, v.shape[-1], dtype=qf.dtype, device=q.device)
    kpad = torch.nn.functional.pad(up(k), (0, 0, 0, block))
    vpad = torch.nn.functional.pad(up(v), (0, 0, 0, block))
    for j in range(blocks.shape[-1]):
        idx = blocks[..., j : j + 1] * block + torch.arange(block, device=q.device)  # [h, t, block]
        kb = kpad.gather(1, idx.reshape(h, -1, 1).expand(-1, -1, d)).view(h, t, block, d)
        vb = vpad.gather(1, idx.reshape(h, -1, 1).expand(-1, -1, d)).view(h, t, block, d)
        scores = torch.einsum("htd,htkd->htk", qf, kb)
        scores = scores.masked_fill((idx >= s) | (idx > q_pos), -math.inf)
        new_max = torch.maximum(run_max, scores.amax(-1, keepdim=True))
        safe = new_max.nan_to_num(0.0, neginf=0.0)
        correction = torch.exp(run_max - safe)
        p = torch.exp(scores - safe)
        run_sum = run_sum * correction + p.sum(-1, keepdim=True)
        acc = acc * correction + torch.einsum("htk,htkd->htd", p, vb)
        run_max = new_max
    return (acc / run_sum).to(q.dtype)
