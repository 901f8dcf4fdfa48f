"""Attention with learned sinks (gpt-oss): one logit per query head joins every softmax
denominator and contributes no value, so a query may attend to "nothing"; with causal and
sliding-window masks, GQA and left padding.

out = sum_j exp(s_j - m) v_j / (exp(sink_h - m) + sum_j exp(s_j - m)), m the row's max over
the scores and the sink. A fully masked query row (left padding) gives zeros: its only term is
the sink, which carries no value.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, candidate, register_operator
from operators._common import logit_reach, tier_cases, up
from operators._tiles import split_softmax
from operators.attention import attention_mask, attention_scores


def _case(name: str, b: int, hq: int, hkv: int, t: int, s: int, d: int, **kw: Any) -> Case:
    tier, regime = kw.pop("tier", "smoke"), kw.pop("regime", "ordinary")
    params = {"batch": b, "q_heads": hq, "kv_heads": hkv, "tokens": t, "keys": s, "dim": d}
    return Case(name, params | {"causal": True} | kw, regime, tier)


#: gpt-oss: 64 query heads over 8 KV heads, head dim 64, windows of 128 on alternate layers.
SINK_CASES = tier_cases(
    _case("one-1x1x1x1x1x8", 1, 1, 1, 1, 1, 8),
    _case("gqa-1x8x1x33x33x64", 1, 8, 1, 33, 33, 64),
    _case("window-1x4x4x80x80x32", 1, 4, 4, 80, 80, 32, tier="pr", window=16),
    _case("decode-window-2x8x1x1x300x64", 2, 8, 1, 1, 300, 64, window=128, pad_left=(0, 37)),
    _case("padded-2x4x1x17x17x32", 2, 4, 1, 17, 17, 32, tier="pr", pad_left=(0, 5)),
    _case("sink-dominant-1x4x2x40x40x64", 1, 4, 2, 40, 40, 64, tier="pr", sink_offset=12.0),
    _case("sink-silent-1x4x2x40x40x64", 1, 4, 2, 40, 40, 64, tier="pr", sink_offset=-30.0),
    _case("large-1x4x2x64x64x64", 1, 4, 2, 64, 64, 64, tier="pr", regime="large"),
    _case("gptoss-1x16x2x256x256x64", 1, 16, 2, 256, 256, 64, tier="pr", window=128),
    _case("unaligned-1x6x3x77x77x80", 1, 6, 3, 77, 77, 80, tier="pr", window=29),
    _case("empty-1x4x2x0x5x32", 1, 4, 2, 0, 5, 32, tier="pr"),
    _case("noncontig-1x4x2x31x31x64", 1, 4, 2, 31, 31, 64, tier="pr", noncontiguous=True),
    _case("long-1x8x1x4096x4096x64", 1, 8, 1, 4096, 4096, 64, tier="nightly", window=128),
)


def sink_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    b, t, s, d = case["batch"], case["tokens"], case["keys"], case["dim"]
    pad = case.get("pad_left") or (0,) * b
    return {
        "q": values((b, case["q_heads"], t, d), case.regime, gen),
        # The large regime scales queries only: scores of a few hundred, keys and values of 1.
        "k": values((b, case["kv_heads"], s, d), "ordinary", gen),
        "v": values((b, case["kv_heads"], s, d), "ordinary", gen),
        # gpt-oss's trained sinks are logits of a few units; the offset makes them dominate
        # every score (+12) or vanish against them (-30).
        "sinks": values((case["q_heads"],), "ordinary", gen) * 2 + case.get("sink_offset", 0.0),
        "causal": bool(case.get("causal", False)),
        "window": case.get("window"),
        "pad_left": torch.tensor(pad, dtype=torch.int64),
    }


def attention_sinks_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    causal: bool,
    window: int | None,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    """q [b, hq, t, d], k and v [b, hkv, s, d], sinks [hq] -> [b, hq, t, d] in q's dtype;
    scale d**-0.5, float32 softmax (float64 for float64)."""
    vf = up(v).repeat_interleave(q.shape[1] // k.shape[1], 1)
    logits = sink_logits(q, k, sinks, causal, window, pad_left)
    weights = torch.exp(logits - logits.amax(-1, keepdim=True))  # the sink keeps m finite
    probs = weights[..., :-1] / weights.sum(-1, keepdim=True)
    return (probs @ vf).to(q.dtype)


def sink_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    sinks: torch.Tensor,
    causal: bool,
    window: int | None,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    """The softmax's logits [b, hq, t, s + 1] in the accumulation dtype: the masked scores
    (-inf where masked) and each head's sink last."""
    b, hq, t, _ = q.shape
    scores = attention_scores(q, k, None, None)
    mask = attention_mask(t, k.shape[2], causal, window, pad_left.to(q.device))
    scores = scores.masked_fill(~mask, -math.inf)
    sink = up(sinks).to(scores.dtype)[None, :, None, None].expand(b, hq, t, 1)
    return torch.cat([scores, sink], dim=-1)


def sink_reach(inputs: dict[str, Any]) -> float:
    """The ``exponent_reach`` of attention with sinks, in float64."""
    q, k, sinks = (inputs[name].double() for name in ("q", "k", "sinks"))
    return logit_reach(
        sink_logits(q, k, sinks, inputs["causal"], inputs["window"], inputs["pad_left"])
    )


register_operator(
    Operator(
        name="attention_sinks",
        op_class="attention",
        reference=attention_sinks_reference,
        make_inputs=sink_inputs,
        cases=SINK_CASES,
        reduction_length=lambda case: case["keys"],
        exponent_reach=sink_reach,
        # The module holds the projections and the rotary embedding too: no adapter.
        hf_modules=("GptOssAttention",),
        description="softmax attention with a learned per-head sink logit (gpt-oss)",
    )
)


@candidate("attention_sinks", name="eager")
def attention_sinks_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    causal: bool,
    window: int | None,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    """transformers' eager gpt-oss path: the sink as an extra column of the logits, max
    subtracted, softmax in float32, the column dropped, probabilities rounded to v's dtype
    before the product with v."""
    b, hq, t, d = q.shape
    group = hq // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q.float(), kr.float().transpose(2, 3)) * d**-0.5
    mask = attention_mask(t, k.shape[2], causal, window, pad_left.to(q.device))
    scores = scores.masked_fill(~mask, -math.inf)
    combined = torch.cat([scores, sinks.float().reshape(1, -1, 1, 1).expand(b, -1, t, 1)], -1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), vr)


#: KV tile of the tiled candidate.
KV_TILE = 64


@candidate("attention_sinks", name="tiled")
def attention_sinks_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    causal: bool,
    window: int | None,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    """Flash-decoding style: KV tiles of 64, each with its own max and float32 sum, p rounded
    to q's dtype before PV, tiles merged by rescaling to the overall max, the sink joining
    the max and the sum (its own term, with no value)."""
    d = q.shape[-1]
    kv_head = torch.arange(q.shape[1], device=q.device) // (q.shape[1] // k.shape[1])
    qf = up(q) * d**-0.5
    mask = attention_mask(q.shape[2], k.shape[2], causal, window, pad_left.to(q.device))
    scores = (qf @ up(k[:, kv_head]).transpose(-1, -2)).masked_fill(~mask, -math.inf)
    sink = up(sinks)[None, :, None, None]
    weights, total, _ = split_softmax(scores, KV_TILE, sink=sink, p_dtype=q.dtype)
    return (weights @ up(v[:, kv_head]) / total).to(q.dtype)
