"""KV-cache quantization: float8 E4M3 and symmetric int8 keys and values, with one scale per
tensor, per head or per token, the round trip, and attention over the quantized cache.

- ``kv_quant``: x [b, h, s, d] -> (codes [b, h, s, d], scale). Codes are int8 for int8 and
  the uint8 bit patterns of E4M3 for fp8 (vLLM stores its fp8 cache as uint8; see
  ``operators/fp8_block.py`` for why bits). Scales are float32 (float64 for float64
  inputs): [1, 1, 1, 1] per tensor (transformers' ``Fp8QuantizedLayer``), [1, h, 1, 1] per
  head (vLLM's per-head scales), [b, h, s, 1] per token (KIVI's keys per token); scale =
  max|x| / 448 (fp8) or / 127 (int8) over the group, 1 for an all-zero group. The codes are
  judged by their rounding (``kind="quantized"``) in the format and over the scale groups
  that ``code_layout`` declares per case: an E5M2 cache, a truncating quantizer or a scale
  of another granularity fails.
- ``kv_dequant``: codes and scales (in the dtype under test) -> values in that dtype.
- ``kv_quant_attention``: causal GQA attention of q [b, hq, t, d] over the quantized keys and
  values -> [b, hq, t, d] in q's dtype.

transformers has no module for these (its quantized caches are ``Cache`` layers, not
``nn.Module``s: ``Fp8QuantizedLayer`` is the per-tensor fp8 case), so no HF module maps here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from numalign.ops.cases import Case, values
from numalign.ops.registry import CodeLayout, Operator, Output, candidate, register_operator
from operators._common import acc, divide_or_zero, tier_cases, up
from operators._tiles import split_softmax
from operators.attention import attention_mask, masked_softmax
from operators.fp8_block import FP8_MAX, decode_fp8, encode_fp8

INT8_MAX = 127.0
QMAX = {"fp8": FP8_MAX, "int8": INT8_MAX}
#: The dims each granularity reduces over, for x [b, h, s, d].
REDUCED = {"tensor": (0, 1, 2, 3), "head": (0, 2, 3), "token": (3,)}


def group_amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """max |x| over each scale's group, keepdim, in ``acc(x)`` (0 for empty groups)."""
    dims = REDUCED[granularity]
    shape = [1 if i in dims else n for i, n in enumerate(x.shape)]
    if any(x.shape[i] == 0 for i in dims):  # amax refuses empty reductions
        return torch.zeros(shape, dtype=acc(x), device=x.device)
    return up(x).abs().amax(dim=dims, keepdim=True)


def encode(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """Scaled values -> codes: E4M3 bits (uint8) or int8, saturating."""
    if fmt == "fp8":
        return encode_fp8(y)
    return torch.round(y).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def decode(codes: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """Codes -> their values (before scaling) in ``dtype``; exact."""
    return decode_fp8(codes, dtype) if fmt == "fp8" else codes.to(dtype)


def kv_quant_reference(
    x: torch.Tensor, fmt: str, granularity: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, h, s, d] -> (codes, scale); see the module docstring."""
    amax = group_amax(x, granularity)
    scale = torch.where(amax > 0, amax / QMAX[fmt], torch.ones_like(amax))
    return encode(up(x) / scale, fmt), scale


def _q(name: str, b: int, h: int, s: int, d: int, fmt: str, gran: str, **kw: Any) -> Case:
    tier, regime = kw.pop("tier", "smoke"), kw.pop("regime", "ordinary")
    params = {"batch": b, "heads": h, "keys": s, "dim": d, "fmt": fmt, "granularity": gran}
    return Case(name, params | kw, regime, tier)


QUANT_CASES = tier_cases(
    _q("one-1x1x1x1-fp8-token", 1, 1, 1, 1, "fp8", "token"),
    _q("fp8-head-2x4x33x64", 2, 4, 33, 64, "fp8", "head"),
    _q("int8-token-2x4x33x128", 2, 4, 33, 128, "int8", "token"),
    _q("fp8-tensor-1x8x64x128", 1, 8, 64, 128, "fp8", "tensor", tier="pr"),
    _q(
        "int8-head-outliers-1x4x100x128",
        1,
        4,
        100,
        128,
        "int8",
        "head",
        tier="pr",
        regime="outliers",
    ),
    _q("fp8-token-small-1x4x50x64", 1, 4, 50, 64, "fp8", "token", tier="pr", regime="small"),
    _q("int8-token-large-1x4x50x64", 1, 4, 50, 64, "int8", "token", tier="pr", regime="large"),
    _q("int8-zero-token-1x2x9x64", 1, 2, 9, 64, "int8", "token", tier="pr", zero_token=True),
    _q("fp8-unaligned-1x3x77x80", 1, 3, 77, 80, "fp8", "token", tier="pr"),
    # multiples of 1/4 up to 1: x / scale = 63.5 is an exact rounding tie (to even: 64)
    _q("int8-ties-1x2x16x64", 1, 2, 16, 64, "int8", "token", tier="pr", regime="ties"),
    _q("fp8-head-empty-1x4x0x64", 1, 4, 0, 64, "fp8", "head", tier="pr"),
    _q("int8-noncontig-1x4x31x64", 1, 4, 31, 64, "int8", "head", tier="pr", noncontiguous=True),
    _q("fp8-long-1x8x8192x128", 1, 8, 8192, 128, "fp8", "token", tier="nightly"),
)


#: The code format of each cache format.
CODES = {"fp8": "float8_e4m3fn", "int8": "int8"}


def code_layout(case: Case) -> CodeLayout:
    """The codes' format and scale groups on ``case``: along a dimension the granularity
    reduces over, one scale for the whole of it (None); along the others, one per element."""
    reduced = REDUCED[case["granularity"]]
    return CodeLayout(CODES[case["fmt"]], tuple(None if i in reduced else 1 for i in range(4)))


def kv_quant_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    x = values((case["batch"], case["heads"], case["keys"], case["dim"]), case.regime, gen)
    if case.get("zero_token"):
        x[:, :, 3] = 0.0  # an unwritten (zeroed) cache slot: its scale must not be 0
    return {"x": x, "fmt": case["fmt"], "granularity": case["granularity"]}


register_operator(
    Operator(
        name="kv_quant",
        op_class="quantization",
        reference=kv_quant_reference,
        make_inputs=kv_quant_inputs,
        cases=QUANT_CASES,
        outputs=(
            Output(
                "codes",
                kind="quantized",
                quantized_from="x",
                scale_from="scale",
                layout=code_layout,
            ),
            Output("scale"),
        ),
        description="KV-cache quantization: fp8 E4M3 or int8, per tensor, head or token",
    )
)


@candidate("kv_quant", name="torch")
def kv_quant_torch(
    x: torch.Tensor, fmt: str, granularity: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Straight: amax, divide, round (transformers' Fp8QuantizedLayer per tensor)."""
    amax = group_amax(x, granularity)
    scale = torch.where(amax > 0, amax / QMAX[fmt], torch.ones_like(amax))
    y = x.float() / scale.float()
    if fmt == "fp8":
        return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8), scale
    return y.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


@candidate("kv_quant", name="reciprocal")
def kv_quant_reciprocal(
    x: torch.Tensor, fmt: str, granularity: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One reciprocal per group, then a multiply per element, as vectorized kernels do."""
    amax = group_amax(x, granularity)
    scale = torch.where(amax > 0, amax / QMAX[fmt], torch.ones_like(amax))
    return encode(up(x) * (1.0 / scale), fmt), scale


def kv_dequant_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    made = kv_quant_inputs(case, gen)
    codes, scale = kv_quant_reference(**made)
    return {"codes": codes, "scale": scale, "fmt": made["fmt"]}


def kv_dequant_reference(codes: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """codes [b, h, s, d] times their scale (broadcast) -> the scale's dtype; the product in
    float32 (float64 for float64)."""
    return (decode(codes, fmt, acc(scale)) * up(scale)).to(scale.dtype)


register_operator(
    Operator(
        name="kv_dequant",
        op_class="quantization",
        reference=kv_dequant_reference,
        make_inputs=kv_dequant_inputs,
        cases=QUANT_CASES,
        description="KV-cache dequantization: fp8 E4M3 or int8 codes times their scales",
    )
)


@candidate("kv_dequant", name="torch")
def kv_dequant_torch(codes: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """In the output dtype directly, as an unfused model does."""
    return decode(codes, fmt, scale.dtype) * scale


@candidate("kv_dequant", name="float32")
def kv_dequant_float32(codes: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """In float32 registers, rounded once on the store, as a fused dequantize kernel does."""
    return (decode(codes, fmt, torch.float32) * scale.float()).to(scale.dtype)


# --- attention over the quantized cache ---------------------------------------------------
def _a(name: str, b: int, hq: int, hkv: int, t: int, s: int, d: int, fmt: str, gran: str,
       **kw: Any) -> Case:  # fmt: skip
    tier, regime = kw.pop("tier", "smoke"), kw.pop("regime", "ordinary")
    params = {"batch": b, "q_heads": hq, "kv_heads": hkv, "tokens": t, "keys": s, "dim": d,
              "fmt": fmt, "granularity": gran}  # fmt: skip
    return Case(name, params | kw, regime, tier)


ATTENTION_CASES = tier_cases(
    _a("one-1x1x1x1x1x8-fp8-token", 1, 1, 1, 1, 1, 8, "fp8", "token"),
    _a("fp8-head-decode-2x8x2x1x300x64", 2, 8, 2, 1, 300, 64, "fp8", "head", pad_left=(0, 37)),
    _a("int8-token-prefill-1x4x2x33x33x64", 1, 4, 2, 33, 33, 64, "int8", "token"),
    _a("fp8-tensor-1x8x1x17x40x128", 1, 8, 1, 17, 40, 128, "fp8", "tensor", tier="pr"),
    _a(
        "int8-head-large-1x4x2x24x24x64",
        1,
        4,
        2,
        24,
        24,
        64,
        "int8",
        "head",
        tier="pr",
        regime="large",
    ),
    _a("fp8-token-llm-1x32x8x1x1024x128", 1, 32, 8, 1, 1024, 128, "fp8", "token", tier="pr"),
    _a("int8-token-unaligned-1x6x3x77x77x80", 1, 6, 3, 77, 77, 80, "int8", "token", tier="pr"),
    _a(
        "fp8-token-padded-2x4x1x17x17x32",
        2,
        4,
        1,
        17,
        17,
        32,
        "fp8",
        "token",
        tier="pr",
        pad_left=(0, 5),
    ),
    _a("fp8-head-empty-1x4x2x0x5x32", 1, 4, 2, 0, 5, 32, "fp8", "head", tier="pr"),
    _a(
        "int8-noncontig-1x4x2x31x31x64",
        1,
        4,
        2,
        31,
        31,
        64,
        "int8",
        "token",
        tier="pr",
        noncontiguous=True,
    ),
    _a("fp8-long-1x8x2x1x32768x128", 1, 8, 2, 1, 32768, 128, "fp8", "token", tier="nightly"),
)


def kv_attention_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    b, hkv, s, d = case["batch"], case["kv_heads"], case["keys"], case["dim"]
    fmt, gran = case["fmt"], case["granularity"]
    k_codes, k_scale = kv_quant_reference(values((b, hkv, s, d), "ordinary", gen), fmt, gran)
    v_codes, v_scale = kv_quant_reference(values((b, hkv, s, d), "ordinary", gen), fmt, gran)
    pad = case.get("pad_left") or (0,) * b
    return {
        # The large regime scales queries only: scores of a few hundred.
        "q": values((b, case["q_heads"], case["tokens"], d), case.regime, gen),
        "k_codes": k_codes,
        "k_scale": k_scale,
        "v_codes": v_codes,
        "v_scale": v_scale,
        "fmt": fmt,
        "pad_left": torch.tensor(pad, dtype=torch.int64),
    }


def kv_quant_attention_reference(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    fmt: str,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    """Causal attention (scale d**-0.5, GQA) over K and V dequantized to q's dtype (as
    transformers' quantized caches hand them back: the product of a code and a scale needs
    more bits than bfloat16 has, and that rounding is part of the honest error), softmax and
    products in float32 (float64 for float64): -> [b, hq, t, d] in q's dtype; fully masked
    rows give zeros."""
    _, hq, t, d = q.shape
    s = k_codes.shape[2]
    group = hq // k_codes.shape[1]
    k = up(kv_dequant_reference(k_codes, k_scale.to(q.dtype), fmt)).repeat_interleave(group, 1)
    v = up(kv_dequant_reference(v_codes, v_scale.to(q.dtype), fmt)).repeat_interleave(group, 1)
    scores = up(q) @ k.transpose(-1, -2) * d**-0.5
    probs = masked_softmax(scores, attention_mask(t, s, True, None, pad_left.to(q.device)))
    return (probs @ v).to(q.dtype)


register_operator(
    Operator(
        name="kv_quant_attention",
        op_class="attention",
        reference=kv_quant_attention_reference,
        make_inputs=kv_attention_inputs,
        cases=ATTENTION_CASES,
        reduction_length=lambda case: case["keys"],
        description="causal GQA attention over an fp8 or int8 quantized KV cache",
    )
)


@candidate("kv_quant_attention", name="dequant_sdpa")
def kv_quant_attention_dequant_sdpa(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    fmt: str,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    """Dequantize the cache to q's dtype (as transformers' quantized caches hand it back),
    then F.scaled_dot_product_attention."""
    k = decode(k_codes, fmt, q.dtype) * k_scale.to(q.dtype)
    v = decode(v_codes, fmt, q.dtype) * v_scale.to(q.dtype)
    mask = attention_mask(q.shape[2], k.shape[2], True, None, pad_left.to(q.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


#: KV tile of the fused candidate.
KV_TILE = 64


@candidate("kv_quant_attention", name="fused")
def kv_quant_attention_fused(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    fmt: str,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    """A fused decode kernel: tiles of 64 raw codes in float32; the key scale multiplies
    the scores and the value scale the probabilities (per token) or the output (per head
    or tensor), never the cache; each tile's softmax against its own max, the tiles merged
    by rescaling (split-KV)."""
    b, hq, t, d = q.shape
    s = k_codes.shape[2]
    kv_head = torch.arange(hq, device=q.device) // (hq // k_codes.shape[1])
    ks = k_scale.float().expand(b, -1, s, 1)[:, kv_head].transpose(-1, -2)  # [b, hq, 1, s]
    vs = v_scale.float().expand(b, -1, s, 1)[:, kv_head].transpose(-1, -2)
    per_token_v = v_scale.shape[2] != 1
    kf = decode(k_codes[:, kv_head], fmt, torch.float32)
    vf = decode(v_codes[:, kv_head], fmt, torch.float32)
    scores = ((q.float() * d**-0.5) @ kf.transpose(-1, -2)) * ks
    mask = attention_mask(t, s, True, None, pad_left.to(q.device))
    weights, total, _ = split_softmax(scores.masked_fill(~mask, -math.inf), KV_TILE)
    out = (weights * vs if per_token_v else weights) @ vf
    if not per_token_v:
        out = out * vs[..., :1].transpose(-1, -2)
    return divide_or_zero(out, total).to(q.dtype)


@candidate("kv_quant_attention", name="exp2")
def kv_quant_attention_exp2(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    fmt: str,
    pad_left: torch.Tensor,
) -> torch.Tensor:
    """Flash kernels' base-2 softmax: d**-0.5 * log2(e) folded into q before the dot product
    (one float32 rounding more than the reference's, at scores of a few hundred in the large
    regime), then exp2; the cache dequantized to q's dtype as transformers hands it back."""
    d = q.shape[-1]
    group = q.shape[1] // k_codes.shape[1]
    k = (decode(k_codes, fmt, q.dtype) * k_scale.to(q.dtype)).float().repeat_interleave(group, 1)
    v = (decode(v_codes, fmt, q.dtype) * v_scale.to(q.dtype)).float().repeat_interleave(group, 1)
    scores = (q.float() * (d**-0.5 * math.log2(math.e))) @ k.transpose(-1, -2)
    mask = attention_mask(q.shape[2], k.shape[2], True, None, pad_left.to(q.device))
    scores = scores.masked_fill(~mask, -math.inf)
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp2(scores - torch.where(torch.isfinite(top), top, 0.0))
    return divide_or_zero(weights @ v, weights.sum(-1, keepdim=True)).to(q.dtype)
