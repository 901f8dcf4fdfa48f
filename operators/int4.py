"""Group-wise int4 weights with zero points (GPTQ / AWQ style): dequantize, and the int4 x
float GEMM.

Layout (nn.Linear orientation, packed along the input dimension):

- ``qweight``: the codes q in [0, 15] of the weight [n, k], packed along k, either 8 nibbles
  per int32 ([n, ceil(k / 8)], nibble j at bits 4j..4j+3 holds column 8w + j, GPTQ's order;
  nibble 7 holds the sign bit, so half the words are negative) or 2 per uint8
  ([n, ceil(k / 2)], the low nibble holds the even column); padding nibbles are 0;
- ``qzeros``: the zero points z in [0, 15] of each (row, group), packed the same way over the
  groups ([n, ceil(groups / 8)] int32 or [n, ceil(groups / 2)] uint8);
- ``scales``: [n, groups] floats, groups = ceil(k / group_size) (group 128 by default);
- ``in_features``: k (the packing pads it to a whole word).

w[r, c] = (q[r, c] - z[r, c // g]) * s[r, c // g]. transformers 5 loads GPTQ and AWQ
checkpoints into gptqmodel's ``*QuantLinear`` modules, whose buffers use other layouts (GPTQ
packs [k / 8, n], AWQ interleaves its nibbles): the operators stand for them, without an
adapter.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, candidate, register_operator
from operators._common import acc, tier_cases, up
from operators._tiles import tile_products

INT4_MAX = 15
#: GPTQ's and AWQ's default group.
GROUP = 128
#: nibbles per container
PER_WORD = {torch.int32: 8, torch.uint8: 2}
#: GPTQ and AWQ checkpoints loaded by transformers 5 become gptqmodel's *QuantLinear modules.
INT4_HF_MODULES = ("*QuantLinear", "WQLinear_*")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def unpack_int4(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Packed nibbles [..., words] (int32 or uint8) -> int64 codes [..., count] in [0, 15]."""
    per = PER_WORD[packed.dtype]
    shifts = torch.arange(0, 4 * per, 4, device=packed.device)
    # int64 first: the arithmetic shift of a negative int32 then keeps the low bits right
    nibbles = (packed.to(torch.int64)[..., None] >> shifts) & INT4_MAX
    return nibbles.flatten(-2)[..., :count]


def pack_int4(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 codes [..., count] in [0, 15] -> packed [..., ceil(count / per)] in ``dtype``."""
    per = PER_WORD[dtype]
    count = codes.shape[-1]
    padded = F.pad(codes, (0, _ceil(count, per) * per - count))
    shifts = torch.arange(0, 4 * per, 4, device=codes.device)
    words = (padded.reshape(*padded.shape[:-1], padded.shape[-1] // per, per) << shifts).sum(-1)
    if dtype == torch.int32:
        words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement
    return words.to(dtype)


def dequant_reference(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """-> w [n, k] in the scales' dtype; (q - z) * s taken in float32 (float64 for float64
    scales): one rounding, as a careful kernel does."""
    q = unpack_int4(qweight, in_features)
    z = unpack_int4(qzeros, scales.shape[-1])
    z_full = z.repeat_interleave(group_size, -1)[..., :in_features]
    s_full = up(scales).repeat_interleave(group_size, -1)[..., :in_features]
    return ((q - z_full).to(s_full.dtype) * s_full).to(scales.dtype)


def _c(name: str, m: int, n: int, k: int, packing: str, **kw: Any) -> Case:
    tier, regime = kw.pop("tier", "smoke"), kw.pop("regime", "ordinary")
    params = {"m": m, "n": n, "k": k, "packing": packing, "group": kw.pop("group", GROUP), **kw}
    return Case(name, params, regime, tier)


INT4_CASES = tier_cases(
    _c("one-1x1x1-int32", 1, 1, 1, "int32"),
    _c("gptq-4x256x512-int32", 4, 256, 512, "int32"),
    _c("bytes-4x256x512-uint8", 4, 256, 512, "uint8"),
    _c("unaligned-3x33x300-int32", 3, 33, 300, "int32", tier="pr"),
    _c("group32-2x64x256-uint8", 2, 64, 256, "uint8", group=32, tier="pr"),
    _c("group64-unaligned-5x40x1000-int32", 5, 40, 1000, "int32", group=64, tier="pr"),
    _c("outliers-8x128x1024-int32", 8, 128, 1024, "int32", tier="pr", regime="outliers"),
    _c("small-8x128x512-uint8", 8, 128, 512, "uint8", tier="pr", regime="small"),
    _c("large-4x128x512-int32", 4, 128, 512, "int32", tier="pr", regime="large"),
    _c("decode-1x512x2048-int32", 1, 512, 2048, "int32", tier="pr"),
    _c("empty-0x0x256-int32", 0, 0, 256, "int32", tier="pr"),
    _c("noncontig-5x64x384-uint8", 5, 64, 384, "uint8", tier="pr", noncontiguous=True),
    _c("llm-64x4096x11008-int32", 64, 4096, 11008, "int32", tier="nightly"),
)


def quantize_int4(
    w: torch.Tensor, group_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization of w [n, k] (float64) per (row, group), as GPTQ's
    and AWQ's quantizers do before their error correction: -> (qweight, qzeros, scales)."""
    n, k = w.shape
    groups = _ceil(k, group_size)
    padded = F.pad(w, (0, groups * group_size - k)).reshape(n, groups, group_size)
    # a partial last group: its padding must not widen the range
    valid = F.pad(torch.ones(n, k, dtype=torch.bool), (0, groups * group_size - k))
    valid = valid.reshape(n, groups, group_size)
    hi = padded.masked_fill(~valid, -math.inf).amax(-1).clamp_min(0.0)
    lo = padded.masked_fill(~valid, math.inf).amin(-1).clamp_max(0.0)
    scales = torch.where(hi > lo, (hi - lo) / INT4_MAX, torch.ones_like(hi))
    zeros = torch.round(-lo / scales).clamp(0, INT4_MAX)
    s_full = scales.repeat_interleave(group_size, -1)[:, :k]
    z_full = zeros.repeat_interleave(group_size, -1)[:, :k]
    q = (torch.round(w / s_full) + z_full).clamp(0, INT4_MAX).to(torch.int64)
    return pack_int4(q, dtype), pack_int4(zeros.to(torch.int64), dtype), scales


def int4_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    n, k, g = case["n"], case["k"], case["group"]
    # trained weights: order 1/sqrt(K); the regime shapes them (outlier input channels)
    w = values((n, k), case.regime if case.regime != "large" else "ordinary", gen) / math.sqrt(k)
    container = torch.int32 if case["packing"] == "int32" else torch.uint8
    qweight, qzeros, scales = quantize_int4(w, g, container)
    # the large regime scales the activations: outputs of several hundred
    x = values((case["m"], k), case.regime if case.regime == "large" else "ordinary", gen)
    return {"x": x, "qweight": qweight, "qzeros": qzeros, "scales": scales,
            "group_size": g, "in_features": k}  # fmt: skip


def int4_dequant_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    made = int4_inputs(case, gen)
    del made["x"]
    return made


register_operator(
    Operator(
        name="int4_dequant",
        op_class="quantization",
        reference=dequant_reference,
        make_inputs=int4_dequant_inputs,
        cases=INT4_CASES,
        # (q - z) * s is the sum q * s + (-z * s): kernels that precompute the scaled zero
        # round it apart (in the accumulator, at the group's magnitude) and add it in one
        # fused multiply-add, two roundings where the reference's exact q - z leaves one.
        # Measured (float32, outlier groups, 6 draws): relative L2 1.7 eps against a budget
        # of 1.6 eps without the second rounding's allowance, 0.6 of it with.
        reduction_length=lambda case: 2,
        hf_modules=INT4_HF_MODULES,
        description="group-wise int4 weights with zero points: (q - z) * s",
    )
)


@candidate("int4_dequant", name="torch")
def int4_dequant_torch(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """Straight: unpack, subtract the zero, multiply in the output dtype."""
    q = unpack_int4(qweight, in_features)
    z = unpack_int4(qzeros, scales.shape[-1]).repeat_interleave(group_size, -1)[:, :in_features]
    s = scales.repeat_interleave(group_size, -1)[:, :in_features]
    return (q - z).to(scales.dtype) * s


def _unpack_native(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Unpacking in the container's own width: shift, then mask (the mask undoes the sign
    extension of the int32 shift)."""
    per = PER_WORD[packed.dtype]
    shifts = torch.arange(0, 4 * per, 4, device=packed.device, dtype=packed.dtype)
    return ((packed[..., None] >> shifts) & INT4_MAX).flatten(-2)[..., :count]


@candidate("int4_dequant", name="scaled_zero")
def int4_dequant_scaled_zero(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """AWQ / exllama form: q * s - z * s with the scaled zero per group precomputed, over
    whole groups through a view (float32 arithmetic, exact for 4-bit codes)."""
    groups = scales.shape[-1]
    q = _unpack_native(qweight, groups * group_size).float()  # padding nibbles are zeros
    q = F.pad(q, (0, groups * group_size - q.shape[-1])).reshape(-1, groups, group_size)
    s = scales.float()[..., None]
    zs = (_unpack_native(qzeros, groups).float()[..., None]) * s
    return (q * s - zs).flatten(-2)[:, :in_features].to(scales.dtype)


def int4_gemm_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """x [m, k] times the int4 weight [n, k], transposed -> [m, n] in x's dtype; the weight
    dequantized exactly and the product accumulated in float32 (float64 for float64)."""
    w = dequant_reference(qweight, qzeros, scales.to(acc(x)), group_size, in_features)
    return (up(x) @ w.T).to(x.dtype)


register_operator(
    Operator(
        name="int4_gemm",
        aten=(
            "_weight_int4pack_mm",
            "_weight_int4pack_mm_for_cpu",
            "_weight_int4pack_mm_with_scales_and_zeros",
            "_dyn_quant_matmul_4bit",
        ),
        op_class="matmul",
        reference=int4_gemm_reference,
        make_inputs=int4_inputs,
        cases=INT4_CASES,
        reduction_length=lambda case: case["k"],
        hf_modules=INT4_HF_MODULES,
        description="float activations times group-wise int4 weights with zero points",
    )
)


@candidate("int4_gemm", name="dequant")
def int4_gemm_dequant(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """Dequantize to the activations' dtype, then one F.linear (the torch fallback path of
    GPTQ / AWQ kernels)."""
    w = int4_dequant_torch(qweight, qzeros, scales, group_size, in_features).to(x.dtype)
    return F.linear(x, w)


@candidate("int4_gemm", name="grouped")
def int4_gemm_grouped(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """Marlin-style: per group, x times the integer (q - z) (exact in float32), scaled by the
    group's scale per output and accumulated in float32."""
    q = unpack_int4(qweight, in_features).float()  # [n, k]
    z = unpack_int4(qzeros, scales.shape[-1]).float()  # [n, groups]
    q_minus_z = q - z.repeat_interleave(group_size, -1)[:, :in_features]  # exact integers
    # every group's product at once: [groups, m, n]
    partials = tile_products(x.float(), q_minus_z, group_size)
    return (partials * scales.float().T[:, None, :]).sum(0).to(x.dtype)
