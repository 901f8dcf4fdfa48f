"""A vendor's kernel module for the operators of the newest models (MLA, attention sinks,
block-scaled FP8, int4 weights, quantized KV caches), as it would live outside numalign:
deliberately wrong kernels of realistic kinds (each must fail the suite on the case that
exposes it) and correct but different ones (each must pass in every dtype).

The test copies this file out of the repository and names it with --candidates. Importing
the families registers their operators where the built-in catalogue does not list them yet.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import numalign
from operators import attention as attention_ops
from operators import fp8_block, int4, kv_quant, mla
from operators import sinks as sink_ops

up = mla.up


# --- multi-head latent attention ------------------------------------------------------------
@numalign.candidate("mla", name="wrong_mla_no_mscale")
def mla_no_mscale(q_nope, q_pe, latent, k_pe, w_kv_b, scale, causal, pad_left):
    """Recomputes the softmax scale as qk_head_dim**-0.5 and so drops YaRN's mscale**2: right
    wherever the model uses the plain scale, wrong on a YaRN-scaled DeepSeek-V3."""
    plain = (q_nope.shape[-1] + q_pe.shape[-1]) ** -0.5
    return mla.mla_absorbed(q_nope, q_pe, latent, k_pe, w_kv_b, plain, causal, pad_left)


@numalign.candidate("mla", name="wrong_mla_kv_split")
def mla_kv_split(q_nope, q_pe, latent, k_pe, w_kv_b, scale, causal, pad_left):
    """Reads kv_b_proj's rows as all heads' k_nope first, then all heads' values, instead of
    [k_nope_h; v_h] per head: identical with one head, wrong with several."""
    h, nope = q_nope.shape[1], q_nope.shape[-1]
    rank = latent.shape[-1]
    dv = w_kv_b.shape[0] // h - nope
    w_k, w_v = w_kv_b[: h * nope].view(h, nope, rank), w_kv_b[h * nope :].view(h, dv, rank)
    regrouped = torch.cat([w_k, w_v], dim=1).reshape(-1, rank)
    return mla.mla_absorbed(q_nope, q_pe, latent, k_pe, regrouped, scale, causal, pad_left)


@numalign.candidate("mla", name="right_mla_absorbed_f32")
def mla_absorbed_f32(q_nope, q_pe, latent, k_pe, w_kv_b, scale, causal, pad_left):
    """The absorbed form with every intermediate kept in float32 (and the rotary part folded
    into one concatenated query, as FlashMLA's 576-wide heads do)."""
    _, h, t, nope = q_nope.shape
    s, rank = latent.shape[1], latent.shape[2]
    w = up(w_kv_b).view(h, -1, rank)
    q = torch.cat([torch.einsum("bhtn,hnr->bhtr", up(q_nope), w[:, :nope]), up(q_pe)], -1)
    kv = torch.cat([up(latent), up(k_pe)], -1)[:, None]  # [b, 1, s, rank + rope]
    mask = attention_ops.attention_mask(t, s, causal, None, pad_left)
    scores = (q @ kv.transpose(-1, -2) * scale).masked_fill(~mask, -math.inf)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    o_latent = probs @ up(latent)[:, None]
    return torch.einsum("bhtr,hvr->bhtv", o_latent, w[:, nope:]).to(q_nope.dtype)


# --- attention sinks ------------------------------------------------------------------------
@numalign.candidate("attention_sinks", name="wrong_sink_kv_head")
def sinks_kv_head(q, k, v, sinks, causal, window, pad_left):
    """Indexes the sinks by KV head (h // group) instead of query head: invisible without
    GQA."""
    group = q.shape[1] // k.shape[1]
    shared = sinks[torch.arange(q.shape[1], device=q.device) // group]
    return sink_ops.attention_sinks_reference(q, k, v, shared, causal, window, pad_left)


@numalign.candidate("attention_sinks", name="wrong_sink_window_off_by_one")
def sinks_window_off_by_one(q, k, v, sinks, causal, window, pad_left):
    """A sliding window one key too wide (q - k <= W): invisible until a sequence outgrows
    its window."""
    wider = window + 1 if window is not None else None
    return sink_ops.attention_sinks_reference(q, k, v, sinks, causal, wider, pad_left)


@numalign.candidate("attention_sinks", name="right_sink_lse")
def sinks_lse(q, k, v, sinks, causal, window, pad_left):
    """Ordinary attention, then rescaled by sigmoid(lse - sink): the sink's share of the
    denominator applied after the fact, as FlashAttention-based kernels add sinks."""
    _, hq, t, d = q.shape
    group = hq // k.shape[1]
    scores = up(q) @ up(k).repeat_interleave(group, 1).transpose(-1, -2) * d**-0.5
    mask = attention_ops.attention_mask(t, k.shape[2], causal, window, pad_left)
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, -1, keepdim=True)  # -inf on fully masked rows
    plain = torch.softmax(scores, -1).nan_to_num(0.0) @ up(v).repeat_interleave(group, 1)
    share = torch.sigmoid(lse - up(sinks)[None, :, None, None])
    return (plain * share).to(q.dtype)


# --- block-scaled FP8 -----------------------------------------------------------------------
@numalign.candidate("fp8_block_quant", name="wrong_fp8_tail_group")
def fp8_tail_group(x, block_rows, block_cols):
    """Scales only whole blocks and reuses the last whole block's scale for the ragged tail
    (a kernel that assumes K % 128 == 0)."""
    codes, scale = fp8_block.fp8_block_quant_reference(x, block_rows, block_cols)
    cols = x.shape[1]
    if cols % block_cols and cols > block_cols:
        scale = scale.clone()
        scale[:, -1] = scale[:, -2]
        full = fp8_block.expand_scale(scale, x.shape, (block_rows, block_cols))
        codes = fp8_block.encode_fp8(up(x) / full)
    return codes, scale


@numalign.candidate("fp8_block_gemm", name="wrong_fp8_weight_scale_n")
def fp8_weight_scale_n(a, a_scale, b, b_scale):
    """Applies the first N block's weight scales to every output column: right while
    N <= 128."""
    return fp8_block.fp8_block_gemm_reference(a, a_scale, b, b_scale[:1].expand_as(b_scale))


@numalign.candidate("fp8_block_gemm", name="right_fp8_gemm_dequant_f32")
def fp8_gemm_dequant_f32(a, a_scale, b, b_scale):
    """Dequantizes the weight once, then a float32 GEMM per 1x128 activation group."""
    bf = fp8_block.fp8_block_dequant_reference(b, b_scale.float(), *fp8_block.WEIGHT_BLOCK)
    af = fp8_block.fp8_block_dequant_reference(a, a_scale.float(), *fp8_block.ACT_BLOCK)
    return F.linear(af, bf).to(a_scale.dtype)


# --- int4 weights ---------------------------------------------------------------------------
@numalign.candidate("int4_dequant", name="wrong_int4_sign_extension")
def int4_sign_extension(qweight, qzeros, scales, group_size, in_features):
    """Unpacks int32 words with an arithmetic shift and masks every nibble but the top one:
    nibble 7 comes out sign-extended (negative) whenever the word is negative."""
    per = int4.PER_WORD[qweight.dtype]
    shifts = torch.arange(0, 4 * per, 4, device=qweight.device, dtype=qweight.dtype)
    nib = qweight[..., None] >> shifts
    nib = torch.where(shifts == 4 * (per - 1), nib, nib & 15) if per == 8 else nib & 15
    q = nib.flatten(-2)[..., :in_features].to(torch.int64)
    z = int4.unpack_int4(qzeros, scales.shape[-1]).repeat_interleave(group_size, -1)
    s = scales.repeat_interleave(group_size, -1)[:, :in_features]
    return (q - z[:, :in_features]).to(scales.dtype) * s


@numalign.candidate("int4_gemm", name="wrong_int4_group_128")
def int4_group_128(x, qweight, qzeros, scales, group_size, in_features):
    """Hard-codes GPTQ's default group of 128 (a kernel built for one config): right at 128,
    wrong for group-32 and group-64 checkpoints."""
    return int4.int4_gemm_reference(x, qweight, qzeros, scales, 128, in_features)


@numalign.candidate("int4_gemm", name="right_int4_lut")
def int4_lut(x, qweight, qzeros, scales, group_size, in_features):
    """Dequantizes through a 16-entry table per (row, group) of (q - z) * s, in float32."""
    q = int4.unpack_int4(qweight, in_features)
    z = int4.unpack_int4(qzeros, scales.shape[-1])
    levels = torch.arange(16, device=x.device, dtype=torch.float32)
    table = (levels[None, None] - z[..., None].float()) * scales.float()[..., None]
    group = (torch.arange(in_features, device=x.device) // group_size).expand_as(q)
    w = table[torch.arange(q.shape[0], device=x.device)[:, None], group, q]
    return F.linear(x.float(), w).to(x.dtype)


# --- quantized KV cache ---------------------------------------------------------------------
@numalign.candidate("kv_quant", name="wrong_kv_e5m2")
def kv_e5m2(x, fmt, granularity):
    """Stores the fp8 cache as E5M2 (the other float8 format) with E4M3's range."""
    codes, scale = kv_quant.kv_quant_reference(x, fmt, granularity)
    if fmt == "fp8":
        codes = (up(x) / scale).to(torch.float8_e5m2).view(torch.uint8)
    return codes, scale


@numalign.candidate("kv_quant_attention", name="wrong_kv_scale_gqa")
def kv_scale_gqa(q, k_codes, k_scale, v_codes, v_scale, fmt, pad_left):
    """Key scales looked up for KV head h % kv_heads instead of h // group: a GQA mapping bug
    that only the scales see (the codes are read right)."""
    hq, hkv = q.shape[1], k_codes.shape[1]
    right = torch.arange(hq, device=q.device) // (hq // hkv)
    wrong = torch.arange(hq, device=q.device) % hkv

    def per_query_head(t, heads):
        return t[:, heads] if t.shape[1] > 1 else t

    return kv_quant.kv_quant_attention_reference(
        q,
        per_query_head(k_codes, right),
        per_query_head(k_scale, wrong),
        per_query_head(v_codes, right),
        per_query_head(v_scale, right),
        fmt,
        pad_left,
    )


@numalign.candidate("kv_dequant", name="right_kv_dequant_lut")
def kv_dequant_lut(codes, scale, fmt):
    """Through a 256-entry table of the codes' values (hardware without float8 conversion),
    scaled in float32."""
    every = torch.arange(256, dtype=torch.int64, device=codes.device)
    if fmt == "fp8":
        nan_free = every.masked_fill((every & 0x7F) == 0x7F, 0)  # 0x7F and 0xFF are NaN
        table = kv_quant.decode(nan_free.to(torch.uint8), fmt, torch.float32)
        index = codes.to(torch.int64)
    else:
        table = (every - 128).to(torch.float32)
        index = codes.to(torch.int64) + 128
    return (table[index] * scale.float()).to(scale.dtype)
