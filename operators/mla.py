"""Multi-head latent attention (DeepSeek-V2 / V3 MLA): attention over a compressed KV cache.

The cache holds, per position, one latent c [kv_lora_rank] (after ``kv_a_layernorm``) and
one rotary key k_pe [qk_rope_head_dim] shared by every head. ``kv_b_proj`` (weight
w_kv_b [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]) decompresses the latent into
each head's key part k_nope and its value. Per head h:

    k_h = [c W_UK_h^T, k_pe]      v_h = c W_UV_h^T      q_h = [q_nope_h, q_pe_h]
    out_h = softmax(q_h k_h^T * scale, masked) v_h

- the **naive** form (transformers' ``DeepseekV3Attention``) decompresses K and V, rounding
  them to the model dtype as ``kv_b_proj`` does, and runs ordinary attention;
- the **weight-absorbed** decode form (FlashMLA, vLLM) never decompresses: q_nope is
  absorbed into the latent space (q_nope W_UK), scores are taken against the latent and the
  rotary key, the probabilities weight the latent itself, and W_UV is applied to that
  weighted latent last.

Inputs: q_nope [b, h, t, qk_nope_head_dim], q_pe [b, h, t, qk_rope_head_dim] (rotary already
applied), latent [b, s, kv_lora_rank], k_pe [b, s, qk_rope_head_dim], w_kv_b as above, the
softmax scale (qk_head_dim**-0.5 times YaRN's mscale**2), causal and left padding as in the
``attention`` operator. Output [b, h, t, v_head_dim] in q's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, candidate, register_operator
from operators._common import tier_cases, up
from operators.attention import attention_mask, masked_softmax


def _case(
    name: str, b: int, h: int, t: int, s: int, rank: int, nope: int, rope: int, dv: int, **kw: Any
) -> Case:
    tier, regime = kw.pop("tier", "smoke"), kw.pop("regime", "ordinary")
    params = {"batch": b, "heads": h, "tokens": t, "keys": s, "kv_lora_rank": rank,
              "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": dv}  # fmt: skip
    return Case(name, params | {"causal": True} | kw, regime, tier)


#: DeepSeek-V2-Lite and V3 share kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128; V3 has 128
#: heads, Lite 16. The CPU grid keeps those head dimensions and fewer heads and positions.
MLA_CASES = tier_cases(
    _case("one-1x1x1x1-r8", 1, 1, 1, 1, 8, 8, 4, 8),
    _case("prefill-1x4x33x33-r256", 1, 4, 33, 33, 256, 64, 32, 64),
    _case("decode-2x4x1x80-r128", 2, 4, 1, 80, 128, 32, 16, 32, pad_left=(0, 13)),
    _case(
        "lite-decode-2x16x1x300-r512", 2, 16, 1, 300, 512, 128, 64, 128, tier="pr", pad_left=(0, 37)
    ),
    _case("chunked-1x8x16x100-r512", 1, 8, 16, 100, 512, 128, 64, 128, tier="pr"),
    _case(
        "yarn-scale-1x4x9x40-r512",
        1,
        4,
        9,
        40,
        512,
        128,
        64,
        128,
        tier="pr",
        scale=192**-0.5 * (0.1 * math.log(40) + 1) ** 2,
    ),
    _case("unaligned-1x3x17x17-r300", 1, 3, 17, 17, 300, 40, 24, 56, tier="pr"),
    _case("large-1x4x24x24-r256", 1, 4, 24, 24, 256, 64, 32, 64, tier="pr", regime="large"),
    _case("padded-2x4x17x17-r128", 2, 4, 17, 17, 128, 32, 16, 32, tier="pr", pad_left=(0, 5)),
    _case("empty-1x4x0x5-r64", 1, 4, 0, 5, 64, 32, 16, 32, tier="pr"),
    _case("noncontig-1x4x13x13-r128", 1, 4, 13, 13, 128, 32, 16, 32, tier="pr", noncontiguous=True),
    _case("v3-decode-1x32x1x4096-r512", 1, 32, 1, 4096, 512, 128, 64, 128, tier="nightly"),
)


def mla_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    b, h, t, s = case["batch"], case["heads"], case["tokens"], case["keys"]
    rank, nope, rope = case["kv_lora_rank"], case["qk_nope_head_dim"], case["qk_rope_head_dim"]
    pad = case.get("pad_left") or (0,) * b
    return {
        # The large regime scales queries only: scores of a few hundred.
        "q_nope": values((b, h, t, nope), case.regime, gen),
        "q_pe": values((b, h, t, rope), case.regime, gen),
        "latent": values((b, s, rank), "ordinary", gen),  # RMS-normalized: order 1
        "k_pe": values((b, s, rope), "ordinary", gen),
        # kv_b_proj of a trained model keeps its outputs of order 1: entries ~ 1/sqrt(rank)
        "w_kv_b": values((h * (nope + case["v_head_dim"]), rank), "ordinary", gen) / rank**0.5,
        "scale": case.get("scale", (nope + rope) ** -0.5),
        "causal": bool(case.get("causal", False)),
        "pad_left": torch.tensor(pad, dtype=torch.int64),
    }


def mla_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    w_kv_b: torch.Tensor,
    scale: float,
    causal: bool,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    """The naive form: K and V decompressed (float32 accumulation, rounded to the input dtype
    as ``kv_b_proj`` does), then attention with a float32 softmax."""
    b, h, t, nope = q_nope.shape
    s = latent.shape[1]
    kv = (up(latent) @ up(w_kv_b).T).to(latent.dtype)  # [b, s, h * (nope + dv)]
    kv = kv.view(b, s, h, -1).transpose(1, 2)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = torch.cat([up(k_nope), up(k_pe)[:, None].expand(b, h, s, -1)], dim=-1)
    q = torch.cat([up(q_nope), up(q_pe)], dim=-1)
    mask = attention_mask(t, s, causal, None, pad_left.to(q.device))
    probs = masked_softmax(q @ k.transpose(-1, -2) * scale, mask)
    return (probs @ up(v)).to(q_nope.dtype)


register_operator(
    Operator(
        name="mla",
        op_class="attention",
        reference=mla_reference,
        make_inputs=mla_inputs,
        cases=MLA_CASES,
        reduction_length=lambda case: max(case["keys"], case["kv_lora_rank"]),
        # These modules hold the projections, norms and rotary embedding too: no adapter.
        hf_modules=(
            "DeepseekV2Attention",
            "DeepseekV3Attention",
            "DeepseekV32Attention",
            "Glm4MoeLiteAttention",
            "GlmMoeDsaAttention",
            "KimiLinearAttention",
            "LongcatFlashMLA",
            "MiniCPM3Attention",
            "Mistral4Attention",
            "MistralLarge4TextAttention",
            "YoutuAttention",
        ),
        description="multi-head latent attention (DeepSeek MLA): naive vs weight-absorbed",
    )
)


@candidate("mla", name="naive_sdpa")
def mla_naive_sdpa(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    w_kv_b: torch.Tensor,
    scale: float,
    causal: bool,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    """transformers' path: kv_b_proj as F.linear in the model dtype, K assembled from k_nope
    and the shared k_pe, then F.scaled_dot_product_attention (value dim != query dim)."""
    b, h, t, nope = q_nope.shape
    s = latent.shape[1]
    kv = F.linear(latent, w_kv_b).view(b, s, h, -1).transpose(1, 2)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = torch.cat([k_nope, k_pe[:, None].expand(b, h, s, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    mask = attention_mask(t, s, causal, None, pad_left.to(q.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@candidate("mla", name="absorbed")
def mla_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    w_kv_b: torch.Tensor,
    scale: float,
    causal: bool,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    """The weight-absorbed form: q_nope W_UK (rounded to the input dtype, the kernel's query),
    scores against the latent plus the rotary part in float32, the latent weighted by the
    probabilities (rounded to the input dtype), then W_UV per head."""
    _, h, t, nope = q_nope.shape
    s, rank = latent.shape[1], latent.shape[2]
    w = w_kv_b.view(h, -1, rank)
    w_uk, w_uv = up(w[:, :nope]), up(w[:, nope:])  # [h, nope, rank], [h, dv, rank]
    q_latent = torch.einsum("bhtn,hnr->bhtr", up(q_nope), w_uk).to(q_nope.dtype)
    c = up(latent)[:, None]  # one latent for every head: [b, 1, s, rank]
    scores = up(q_latent) @ c.transpose(-1, -2) + up(q_pe) @ up(k_pe)[:, None].transpose(-1, -2)
    mask = attention_mask(t, s, causal, None, pad_left.to(q_nope.device))
    probs = masked_softmax(scores * scale, mask)
    o_latent = (probs @ c).to(q_nope.dtype)  # [b, h, t, rank]
    return torch.einsum("bhtr,hvr->bhtv", up(o_latent), w_uv).to(q_nope.dtype)
