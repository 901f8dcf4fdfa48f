"""Kernels for the grid-gap tests, as a vendor's module would hold them: each wrong kernel
has a bug that the operator grid once let through (each must now fail, on the case named in
``test_grid_gaps.py``); each right kernel is honest but differs from the built-ins (each must
pass in every dtype).

The test copies this file out of the repository and names it with --candidates.
"""

from __future__ import annotations

import math

import torch

import numalign
from operators import attention, fp8_block, kv_quant, moe, norms

up = norms.up


# --- wrong kernels --------------------------------------------------------------------------
@numalign.candidate("attention", name="wrong_softcap_after_mask")
def attention_softcap_after_mask(q, k, v, causal, window, softcap, scale, pad_left):
    """Masks with -inf, then soft-caps: masked keys score -cap, not -inf. Rows without any
    visible key are zeroed, as careful kernels do, so only the cap's order is wrong."""
    group = q.shape[1] // k.shape[1]
    kf, vf = up(k).repeat_interleave(group, 1), up(v).repeat_interleave(group, 1)
    scores = up(q) @ kf.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    mask = attention.attention_mask(q.shape[2], k.shape[2], causal, window, pad_left)
    scores = scores.masked_fill(~mask, -math.inf)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0) * mask.any(-1, keepdim=True)
    return (probs @ vf).to(q.dtype)


@numalign.candidate("rms_norm", name="wrong_ignores_offset")
def rms_ignores_offset(x, weight, eps, offset=0.0):
    """Multiplies by the weight alone: right for Llama, wrong for Gemma's 1 + weight."""
    return norms.rms_norm_reference(x, weight, eps, 0.0)


@numalign.candidate("add_rms_norm", name="wrong_ignores_offset")
def add_rms_ignores_offset(x, residual, weight, eps, offset=0.0):
    return norms.add_rms_norm_reference(x, residual, weight, eps, 0.0)


@numalign.candidate("quantize_int8", name="wrong_truncates")
def quantize_int8_truncates(x):
    """Truncates x / scale toward zero (a float-to-int conversion without rounding)."""
    absmax = up(x).abs().amax(-1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax)).to(x.dtype)
    return torch.trunc(up(x) / up(scale)).clamp(-127, 127).to(torch.int8), scale


@numalign.candidate("quantize_fp8", name="wrong_truncates")
def quantize_fp8_truncates(x):
    """Rounds x / scale toward zero on the float8 grid (round-to-zero conversion)."""
    absmax = up(x).abs().amax()
    scale = torch.where(absmax > 0, absmax / 448.0, torch.ones_like(absmax)).to(x.dtype)
    v = (up(x) / up(scale)).clamp(-448.0, 448.0)
    q = v.to(torch.float8_e4m3fn)
    # float8 e4m3fn is sign-magnitude: one code down in magnitude is one step toward zero
    over = (q.to(v.dtype).abs() > v.abs()) & (q.to(v.dtype) != 0)
    bits = q.view(torch.uint8)
    bits = torch.where(over, bits - 1, bits)
    return bits.view(torch.float8_e4m3fn), scale


@numalign.candidate("moe_routing", name="wrong_bias_in_weights")
def routing_bias_in_weights(
    logits, bias, top_k, scoring, renormalize, groups, topk_groups, scaling
):
    """Takes the routing weights from the biased choice scores, not from the scores alone."""
    _, experts, choice = moe.routing_reference(
        logits, bias, top_k, scoring, renormalize, groups, topk_groups, scaling
    )
    picked = up(choice).gather(1, experts)
    if renormalize:
        picked = picked / picked.sum(-1, keepdim=True)
    return (picked * scaling).to(logits.dtype), experts, choice


@numalign.candidate("matmul", name="wrong_fp16_accumulator")
def matmul_fp16_accumulator(a, b):
    """Accumulates in float16 for 16-bit inputs (32 terms per step, as a half-precision MMA
    accumulator would): bfloat16 runs drift only where partial sums grow large."""
    acc = torch.float32 if a.dtype in (torch.float32, torch.float64) else torch.float16
    out = torch.zeros(a.shape[0], a.shape[1], b.shape[2], dtype=acc)
    for start in range(0, a.shape[2], 32):
        part = up(a[..., start : start + 32]) @ up(b[:, start : start + 32])
        out = out + part.to(acc)
    return out.to(a.dtype)


def _e4m3(v: torch.Tensor, half: float) -> torch.Tensor:
    """float32 v on the E4M3 grid by hand (no float8 conversion), saturating at 448:
    floor(|v| / step + ``half``) steps, 0.5 rounding half away from zero, 0 toward zero."""
    a = v.abs().clamp(max=fp8_block.FP8_MAX)
    _, exponent = torch.frexp(a)  # a = m * 2**exponent, m in [0.5, 1)
    step = torch.ldexp(torch.ones_like(a), (exponent - 4).clamp_min(-9))  # 3 mantissa bits
    return (torch.sign(v) * torch.floor(a / step + half) * step).to(torch.float8_e4m3fn)


@numalign.candidate("fp8_block_quant", name="wrong_truncates")
def fp8_block_truncates(x, block_rows, block_cols):
    """The reference's block scales, but x / scale rounded toward zero on the E4M3 grid."""
    _, scale = fp8_block.fp8_block_quant_reference(x, block_rows, block_cols)
    full = fp8_block.expand_scale(scale, x.shape, (block_rows, block_cols))
    return _e4m3(up(x) / full, 0.0).view(torch.uint8), scale


@numalign.candidate("kv_quant", name="wrong_truncates")
def kv_truncates(x, fmt, granularity):
    """The reference's scales, but x / scale rounded toward zero (int8 and E4M3 alike)."""
    _, scale = kv_quant.kv_quant_reference(x, fmt, granularity)
    v = up(x) / scale
    if fmt == "fp8":
        return _e4m3(v, 0.0).view(torch.uint8), scale
    return torch.trunc(v).clamp(-127, 127).to(torch.int8), scale


# --- right kernels --------------------------------------------------------------------------
@numalign.candidate("quantize_int8", name="right_half_away")
def quantize_int8_half_away(x):
    """Rounds half away from zero (C's roundf) with a reciprocal multiply: it differs from
    ties-to-even only at exact ties."""
    absmax = up(x).abs().amax(-1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax)).to(x.dtype)
    v = up(x) * (1.0 / up(scale))
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return q.clamp(-127, 127).to(torch.int8), scale


@numalign.candidate("fp8_block_quant", name="right_half_away")
def fp8_block_half_away(x, block_rows, block_cols):
    """One reciprocal per block, a multiply per element, and E4M3 rounding half away from
    zero done by hand (hardware without a float8 conversion)."""
    block = (block_rows, block_cols)
    amax = fp8_block.block_amax(x, block)
    scale = torch.where(amax > 0, amax / fp8_block.FP8_MAX, torch.ones_like(amax))
    v = up(x) * fp8_block.expand_scale(1.0 / scale, x.shape, block)
    return _e4m3(v, 0.5).view(torch.uint8), scale


@numalign.candidate("kv_quant", name="right_half_away")
def kv_half_away(x, fmt, granularity):
    """A reciprocal multiply, then rounding half away from zero (int8 and E4M3 alike)."""
    amax = kv_quant.group_amax(x, granularity)
    scale = torch.where(amax > 0, amax / kv_quant.QMAX[fmt], torch.ones_like(amax))
    v = up(x) * (1.0 / scale)
    if fmt == "fp8":
        return _e4m3(v, 0.5).view(torch.uint8), scale
    return (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-127, 127).to(torch.int8), scale


@numalign.candidate("attention", name="right_softcap_first")
def attention_softcap_first(q, k, v, causal, window, softcap, scale, pad_left):
    """Soft-caps, then adds an additive mask of -inf (as eager Gemma 2 does)."""
    group = q.shape[1] // k.shape[1]
    kf, vf = up(k).repeat_interleave(group, 1), up(v).repeat_interleave(group, 1)
    scores = up(q) @ kf.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = attention.attention_mask(q.shape[2], k.shape[2], causal, window, pad_left)
    scores = scores + torch.zeros_like(scores).masked_fill(~mask, -math.inf)
    return (torch.softmax(scores, dim=-1).nan_to_num(0.0) @ vf).to(q.dtype)


# --- planted bugs in the new operators ------------------------------------------------------
@numalign.candidate("logit_softcap", name="wrong_hard_cap")
def logit_hard_cap(logits, cap):
    """Clamps at +-cap (a hard cap) instead of cap * tanh(x / cap)."""
    return up(logits).clamp(-cap, cap).to(logits.dtype)


@numalign.candidate("log_softmax", name="wrong_no_max")
def log_softmax_no_max(logits):
    """log(sum(exp(x))) without subtracting the max: overflows on large logits."""
    lf = up(logits)
    return (lf - torch.log(torch.exp(lf).sum(-1, keepdim=True))).to(logits.dtype)


@numalign.candidate("cross_entropy", name="wrong_mean_counts_ignored")
def cross_entropy_mean_over_all(logits, labels):
    """Averages over every token, ignored ones included."""
    from operators.logits import cross_entropy_reference

    loss, _ = cross_entropy_reference(logits, labels)
    return loss, (up(loss).sum() / max(loss.shape[0], 1)).to(logits.dtype)


@numalign.candidate("sampling", name="wrong_topp_before_temperature")
def sampling_topp_before_temperature(logits, u, temperature, top_k, top_p):
    """Measures the top-p mass on the unscaled distribution, then applies the temperature
    to the kept tokens."""
    from operators.sampling import _draw, _kept_sorted

    unscaled, order = _kept_sorted(logits, 1.0, top_k, top_p)
    kept = unscaled > 0
    scaled = torch.softmax(up(logits).gather(-1, order) / temperature, dim=-1) * kept
    probs = scaled / scaled.sum(-1, keepdim=True).clamp_min(torch.finfo(scaled.dtype).tiny)
    if logits.shape[0] == 0:
        return order, probs.to(logits.dtype), order[:, :1]
    return order, probs.to(logits.dtype), _draw(probs, order, u)


@numalign.candidate("rope_scaled", name="wrong_no_attention_factor")
def rope_no_attention_factor(x, positions, theta, rope):
    """Forgets YaRN's attention factor (0.1 ln(factor) + 1 on cos and sin)."""
    from operators.rope_scaling import rope_scaling_reference

    return rope_scaling_reference(x, positions, theta, {**rope, "attention_factor": 1.0})


@numalign.candidate("rope_scaled", name="wrong_static_ntk")
def rope_static_ntk(x, positions, theta, rope):
    """Dynamic NTK with the base left at theta: right up to the original context, wrong
    beyond it (the base never grows)."""
    from operators.rope_scaling import rope_scaling_reference

    if rope["rope_type"] == "dynamic":
        rope = {"rope_type": "linear", "factor": 1.0}
    return rope_scaling_reference(x, positions, theta, rope)
