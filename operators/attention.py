"""Scaled dot-product attention: causal and padding masks, GQA and MQA, sliding window, logit
soft-capping and a custom scale. Fully masked query rows (left padding) output zeros."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, candidate, register_operator
from operators._common import divide_or_zero, logit_reach, tier_cases, up
from operators._tiles import split_softmax


def _case(
    name: str,
    b: int,
    hq: int,
    hkv: int,
    t: int,
    s: int,
    d: int,
    tier: str = "smoke",
    regime: str = "ordinary",
    **options: Any,
) -> Case:
    params = {"batch": b, "q_heads": hq, "kv_heads": hkv, "tokens": t, "keys": s, "dim": d}
    return Case(name, params | options, regime=regime, tier=tier)


def _softcap(cap: float, pad_left: tuple[int, ...], **options: Any) -> dict[str, Any]:
    """Options of a causal, left-padded, soft-capped case in the large regime."""
    return {"causal": True, "pad_left": pad_left, "softcap": cap, "regime": "large"} | options


ATTENTION_CASES = tier_cases(
    _case("one-1x1x1x1x1x8", 1, 1, 1, 1, 1, 8),
    _case("gqa-causal-1x8x2x33x33x64", 1, 8, 2, 33, 33, 64, causal=True),
    _case("mqa-padded-2x4x1x17x17x32", 2, 4, 1, 17, 17, 32, causal=True, pad_left=(0, 5)),
    _case("window-1x4x4x80x80x32", 1, 4, 4, 80, 80, 32, causal=True, window=16),
    _case("softcap-1x4x2x40x40x64", 1, 4, 2, 40, 40, 64, causal=True, softcap=50.0),
    _case("decode-2x8x2x1x300x64", 2, 8, 2, 1, 300, 64, causal=True, pad_left=(0, 37)),
    _case("scale-1x2x2x9x13x16", 1, 2, 2, 9, 13, 16, scale=0.05),
    _case("large-1x4x2x64x64x64", 1, 4, 2, 64, 64, 64, tier="pr", regime="large", causal=True),
    _case("llm-1x32x8x256x256x128", 1, 32, 8, 256, 256, 128, tier="pr", causal=True),
    _case("unaligned-1x6x3x77x77x80", 1, 6, 3, 77, 77, 80, tier="pr", causal=True, window=29),
    _case(
        "noncontig-1x4x2x31x31x64", 1, 4, 2, 31, 31, 64, tier="pr", causal=True, noncontiguous=True
    ),
    _case(
        "softcap-window-1x8x4x300x300x128",
        1,
        8,
        4,
        300,
        300,
        128,
        tier="pr",
        causal=True,
        window=128,
        softcap=50.0,
    ),
    _case("long-1x8x2x4096x4096x128", 1, 8, 2, 4096, 4096, 128, tier="nightly", causal=True),
    # Soft-capping meets padding: the cap goes on the scores before the mask; capped after it,
    # masked keys score -cap instead of -inf and padded query rows are no longer empty.
    _case(
        "softcap-padded-2x4x2x17x17x64",
        2,
        4,
        2,
        17,
        17,
        64,
        **_softcap(50.0, (0, 5), regime="ordinary"),
    ),
    # ... and the large regime: scores of a few hundred saturate at +-cap, so a query whose
    # few visible keys all score near -cap weighs masked keys (at -cap) as much as them.
    _case("softcap-large-padded-2x4x2x40x40x64", 2, 4, 2, 40, 40, 64, **_softcap(30.0, (0, 9))),
    _case(
        "softcap-large-window-1x8x4x130x130x128",
        1,
        8,
        4,
        130,
        130,
        128,
        tier="pr",
        **_softcap(50.0, (3,), window=7),
    ),
    # Large scores and a window longer than a tile: the flash-style running max must rescale.
    _case(
        "large-window-1x4x2x200x200x64",
        1,
        4,
        2,
        200,
        200,
        64,
        regime="large",
        causal=True,
        window=100,
    ),
)


def attention_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    b, t, s, d = case["batch"], case["tokens"], case["keys"], case["dim"]
    q = values((b, case["q_heads"], t, d), case.regime, gen)
    # The large regime scales queries only: scores of a few hundred, keys and values of 1.
    k = values((b, case["kv_heads"], s, d), "ordinary", gen)
    v = values((b, case["kv_heads"], s, d), "ordinary", gen)
    pad = case.get("pad_left") or (0,) * b
    return {
        "q": q,
        "k": k,
        "v": v,
        "causal": bool(case.get("causal", False)),
        "window": case.get("window"),
        "softcap": case.get("softcap"),
        "scale": case.get("scale"),
        "pad_left": torch.tensor(pad, dtype=torch.int64),
    }


def attention_mask(
    tokens: int, keys: int, causal: bool, window: int | None, pad_left: torch.Tensor
) -> torch.Tensor:
    """[batch, 1, tokens, keys], True where a query may attend a key. Queries are the last
    ``tokens`` positions of ``keys``; keys before ``pad_left[b]`` are padding."""
    device = pad_left.device
    q_pos = torch.arange(keys - tokens, keys, device=device)[:, None]
    k_pos = torch.arange(keys, device=device)[None, :]
    allowed = torch.ones(tokens, keys, dtype=torch.bool, device=device)
    if causal:
        allowed &= k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    not_pad = k_pos[None] >= pad_left[:, None, None]
    return (allowed[None] & not_pad)[:, None]


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` where ``mask`` is True (in ``scores``' dtype);
    fully masked rows give zeros, not NaN."""
    scores = scores.masked_fill(~mask, -math.inf)
    peak = scores.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    weights = torch.exp(scores - peak)
    total = weights.sum(-1, keepdim=True)
    return divide_or_zero(weights, total)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    window: int | None,
    softcap: float | None,
    scale: float | None,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    vf = up(v).repeat_interleave(q.shape[1] // k.shape[1], 1)
    probs = masked_softmax(
        attention_scores(q, k, scale, softcap),
        attention_mask(q.shape[2], k.shape[2], causal, window, pad_left),
    )
    return (probs @ vf).to(q.dtype)


def attention_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float | None, softcap: float | None
) -> torch.Tensor:
    """q k^T * scale (d**-0.5 by default), soft-capped, in the accumulation dtype, with k's
    heads repeated over q's groups."""
    kf = up(k).repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = up(q) @ kf.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def attention_reach(inputs: dict[str, Any]) -> float:
    """The attention's ``exponent_reach``: its masked scores' farthest distance below their
    row's maximum, in float64."""
    q, k = inputs["q"].double(), inputs["k"].double()
    scores = attention_scores(q, k, inputs["scale"], inputs["softcap"])
    mask = attention_mask(q.shape[2], k.shape[2], inputs["causal"], inputs["window"],
                          inputs["pad_left"])  # fmt: skip
    return logit_reach(scores.masked_fill(~mask, -math.inf))


register_operator(
    Operator(
        name="attention",
        aten=(
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_flash_attention",
            "scaled_dot_product_attention",
        ),
        op_class="attention",
        reference=attention_reference,
        make_inputs=attention_inputs,
        cases=ATTENTION_CASES,
        reduction_length=lambda case: case["keys"],
        exponent_reach=attention_reach,
        hf_modules=("*Attention", "*SdpaAttention"),
        description="softmax(q k^T * scale, masked) v with GQA, window, soft-capping",
    )
)


def _sdpa_supports(case: Case) -> str | None:
    return "SDPA has no logit soft-capping" if case.get("softcap") else None


@candidate("attention", name="sdpa", supports=_sdpa_supports)
def attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    window: int | None,
    softcap: float | None,
    scale: float | None,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    mask = attention_mask(q.shape[2], k.shape[2], causal, window, pad_left.to(q.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


#: KV tile of the tiled candidate.
KV_TILE = 64


@candidate("attention", name="tiled")
def attention_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    window: int | None,
    softcap: float | None,
    scale: float | None,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    """Flash-decoding style: KV tiles of 64, each with its own max and float32 sum, p rounded
    to the input dtype before the PV product as fused kernels do, tiles merged by rescaling
    to the overall max; query head h reads KV head h // (q_heads / kv_heads)."""
    d = q.shape[-1]
    kv_head = torch.arange(q.shape[1], device=q.device) // (q.shape[1] // k.shape[1])
    qf = up(q) * (scale if scale is not None else d**-0.5)
    scores = qf @ up(k[:, kv_head]).transpose(-1, -2)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    mask = attention_mask(q.shape[2], k.shape[2], causal, window, pad_left.to(q.device))
    scores = scores.masked_fill(~mask, -math.inf)
    weights, total, _ = split_softmax(scores, KV_TILE, p_dtype=q.dtype)
    return divide_or_zero(weights @ up(v[:, kv_head]), total).to(q.dtype)
