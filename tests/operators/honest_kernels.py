"""Honest kernels of the newest families that round elsewhere than the references, by design:
a vendor's module, as it would live outside numalign, whose kernels must pass every case in
every dtype, on the committed seeds and on inputs drawn again (``test_honest_reseeded.py``).

- ``int4_dequant`` in the one-rounding affine form: w = fma(q, s, -(z * s)), the scaled zero
  rounded once per group and the product and sum rounded once per element (the reference
  rounds (q - z) * s once);
- ``int4_gemm`` with the zero point folded out of the product: per group s * (x . q) minus
  (z * s) * sum(x), accumulated in float32 (what kernels that keep q unsigned compute);
- ``attention_sinks`` with exp(x) as exp2(x * log2(e)), log2(e) rounded to float32, as fused
  attention kernels scale their scores once into base 2;
- ``attention_sinks`` with the softmax scale and log2(e) folded into one float32 constant
  that multiplies the scores and the sinks before the row's maximum is taken (flash kernels'
  ``softmax_scale_log2``): a row whose sink dominates by 12 leans its weights by the
  constant's rounding times 12.

Each computes in float32 (float64 for float64 inputs) and rounds its output once.
"""

from __future__ import annotations

import math

import torch

import numalign
from operators import int4
from operators._common import acc, up
from operators._tiles import tile_products, tiles
from operators.attention import attention_mask


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a * b + c rounded once to ``dtype`` (a fused multiply-add): float32 operands'
    product and sum are exact in float64, then rounded once."""
    if dtype == torch.float64:
        return a * b + c  # no wider type to emulate it in; float64 is not under test here
    return (a.double() * b.double() + c.double()).to(dtype)


@numalign.candidate("int4_dequant", name="honest_int4_affine_fma")
def int4_dequant_affine_fma(qweight, qzeros, scales, group_size, in_features):
    """w = fma(q, s, -(z * s)) in float32: -z * s rounded once per group, then one fused
    multiply-add per element, rounded to the scales' dtype."""
    k = in_features
    q = int4.unpack_int4(qweight, k).to(acc(scales))
    s = up(scales)
    neg_zs = -(int4.unpack_int4(qzeros, scales.shape[-1]).to(s.dtype) * s)  # one rounding
    s_full = s.repeat_interleave(group_size, -1)[..., :k]
    zs_full = neg_zs.repeat_interleave(group_size, -1)[..., :k]
    return _fma(q, s_full, zs_full, s.dtype).to(scales.dtype)


@numalign.candidate("int4_gemm", name="honest_int4_folded_zero")
def int4_gemm_folded_zero(x, qweight, qzeros, scales, group_size, in_features):
    """Per group g: s_g * (x_g . q_g) - (z_g * s_g) * sum(x_g), the groups summed in float32:
    the zero point folded out of the integer product."""
    f = acc(x)
    q = int4.unpack_int4(qweight, in_features).to(f)  # [n, k]
    s = scales.to(f).T[:, None, :]  # [groups, 1, n]
    zs = (int4.unpack_int4(qzeros, scales.shape[-1]).to(f) * scales.to(f)).T[:, None, :]
    xq = tile_products(x.to(f), q, group_size)  # [groups, m, n]
    xsum = tiles(x.to(f), group_size).sum(-1).T[:, :, None]  # [groups, m, 1]
    return (xq * s - zs * xsum).sum(0).to(x.dtype)


#: log2(e) rounded to float32, as kernels hold it: 1.44269502 (true 1.44269504...).
LOG2E_F32 = float(torch.tensor(math.log2(math.e), dtype=torch.float32))


@numalign.candidate("attention_sinks", name="honest_sink_exp2")
def sinks_exp2(q, k, v, sinks, causal, window, pad_left):
    """Softmax with the sink column, exp(x - m) computed as exp2((x - m) * log2(e)) with
    log2(e) rounded to the accumulator (float32), probabilities in float32."""
    b, hq, t, d = q.shape
    group = hq // k.shape[1]
    f = acc(q)
    log2e = LOG2E_F32 if f == torch.float32 else math.log2(math.e)
    kr, vr = k.repeat_interleave(group, 1).to(f), v.repeat_interleave(group, 1).to(f)
    scores = q.to(f) @ kr.transpose(-1, -2) * d**-0.5
    mask = attention_mask(t, k.shape[2], causal, window, pad_left.to(q.device))
    scores = scores.masked_fill(~mask, -math.inf)
    logits = torch.cat([scores, sinks.to(f).reshape(1, -1, 1, 1).expand(b, -1, t, 1)], -1)
    weights = torch.exp2((logits - logits.amax(-1, keepdim=True)) * log2e)
    probs = weights[..., :-1] / weights.sum(-1, keepdim=True)
    return (probs @ vr).to(q.dtype)


@numalign.candidate("attention_sinks", name="honest_sink_exp2_folded")
def sinks_exp2_folded(q, k, v, sinks, causal, window, pad_left):
    """Softmax with the sink column in base 2: the scores and the sinks multiplied by
    d**-0.5 * log2(e) rounded once to the accumulator, then exp2(y - max y)."""
    b, hq, t, d = q.shape
    group = hq // k.shape[1]
    f = acc(q)
    folded = torch.tensor(d**-0.5 * math.log2(math.e), dtype=f)
    log2e = torch.tensor(math.log2(math.e), dtype=f)
    kr, vr = k.repeat_interleave(group, 1).to(f), v.repeat_interleave(group, 1).to(f)
    scores = (q.to(f) @ kr.transpose(-1, -2)) * folded
    mask = attention_mask(t, k.shape[2], causal, window, pad_left.to(q.device))
    scores = scores.masked_fill(~mask, -math.inf)
    sink = (sinks.to(f) * log2e).reshape(1, -1, 1, 1).expand(b, -1, t, 1)
    logits = torch.cat([scores, sink], -1)
    weights = torch.exp2(logits - logits.amax(-1, keepdim=True))
    probs = weights[..., :-1] / weights.sum(-1, keepdim=True)
    return (probs @ vr).to(q.dtype)
