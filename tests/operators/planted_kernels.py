"""The catalogue of planted kernels: a vendor's kernel module, as it would live outside
numalign, holding deliberately wrong kernels of realistic kinds (each must fail the operator
suite on the case that exposes it) and correct but different ones (each must pass in every
dtype). The tests copy this file out of the repository, name it with ``--candidates`` and
select the kernels they are about (``suite_runner.select``):

- the bug classes of every family (norms, softmax, attention, rotary, linear, routing,
  paged KV, scans, top-k): ``test_planted_bug_classes.py``;
- the grid gaps the case tables once let through (zero-centred norms, soft-capping after the
  mask, truncating quantizers, routing bias, float16 accumulators, logits-side operators,
  scaled rotary): ``test_case_grid_gaps.py``;
- the operators of the newest models (MLA, attention sinks, block-scaled FP8, int4 weights,
  quantized KV caches): ``test_latent_sink_quantized_operators.py``.

Importing the families registers their operators where the built-in catalogue does not list
them yet. Names are unique per operator (``wrong_no_max`` is softmax's and log_softmax's).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import numalign
from operators import attention, fp8_block, int4, kv_quant, linear, mla, moe, norms, paged_kv
from operators import sinks as sink_ops
from operators._common import up

# ==== the bug classes of every family =================================================


# --- wrong kernels: one realistic bug each --------------------------------------------------
@numalign.candidate("rms_norm", name="wrong_eps")
def rms_wrong_eps(x, weight, eps, offset=0.0):
    """Hard-coded epsilon 1e-3 instead of the model's: invisible on ordinary inputs, wrong
    where the mean square is near 1e-4."""
    return norms.rms_norm_reference(x, weight, 1e-3, offset)


@numalign.candidate("rms_norm", name="wrong_no_upcast")
def rms_no_upcast(x, weight, eps, offset=0.0):
    """The sum of squares accumulated in the input dtype, 32 columns at a time."""
    total = torch.zeros_like(x[..., :1])
    for start in range(0, x.shape[-1], 32):
        total = total + x[..., start : start + 32].pow(2).sum(-1, keepdim=True)
    return x * torch.rsqrt(total / x.shape[-1] + eps) * (offset + weight)


@numalign.candidate("softmax", name="wrong_no_max")
def softmax_no_max(x, mask):
    """exp without subtracting the row max: overflows on large logits."""
    e = torch.exp(x.masked_fill(mask, -math.inf))
    return (e / e.sum(-1, keepdim=True)).nan_to_num(0.0)


@numalign.candidate("softmax", name="wrong_nan_rows")
def softmax_nan_rows(x, mask):
    """torch.softmax over a fully masked row: 0 / 0."""
    return torch.softmax(up(x).masked_fill(mask, -math.inf), dim=-1).to(x.dtype)


#: A causal shift past every key: no causal mask.
NO_CAUSAL = 10**9


def _attend(q, k, v, scale, softcap, window, pad_left, shift=0, head_map=None):
    """Plain attention; queries see keys up to their position + shift; query head h reads
    KV head head_map[h] (default h // group)."""
    _, hq, t, d = q.shape
    s = k.shape[2]
    heads = head_map if head_map is not None else torch.arange(hq) // (hq // k.shape[1])
    kf, vf = up(k)[:, heads], up(v)[:, heads]
    scores = up(q) @ kf.transpose(-1, -2) * (scale if scale is not None else d**-0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(s - t, s)[:, None]
    k_pos = torch.arange(s)[None, :]
    allowed = k_pos <= q_pos + shift
    if window is not None:
        allowed &= q_pos - k_pos < window
    allowed = allowed[None] & (k_pos[None] >= pad_left[:, None, None])
    scores = scores.masked_fill(~allowed[:, None], -math.inf)
    return (torch.softmax(scores, -1).nan_to_num(0.0) @ vf).to(q.dtype)


@numalign.candidate("attention", name="wrong_causal_off_by_one")
def attention_off_by_one(q, k, v, causal, window, softcap, scale, pad_left):
    """Each query also sees the next key."""
    shift = 1 if causal else NO_CAUSAL
    return _attend(q, k, v, scale, softcap, window, pad_left, shift=shift)


@numalign.candidate("attention", name="wrong_gqa_mapping")
def attention_wrong_gqa(q, k, v, causal, window, softcap, scale, pad_left):
    """Query head h reads KV head h % kv_heads instead of h // group."""
    heads = torch.arange(q.shape[1]) % k.shape[1]
    shift = 0 if causal else NO_CAUSAL
    return _attend(q, k, v, scale, softcap, window, pad_left, shift=shift, head_map=heads)


@numalign.candidate("rope_neox", name="wrong_interleaved")
def rope_wrong_convention(x, positions, theta):
    """GPT-J interleaved pairs where the model rotates halves (NeoX)."""
    from operators.rotary import rope_gptj_reference

    return rope_gptj_reference(x, positions, theta)


@numalign.candidate("linear", name="wrong_low_precision_acc")
def linear_low_precision(x, weight, bias):
    """Accumulates K in the input dtype, 256 terms at a time: fine at small K in bfloat16,
    drifting at large K."""
    out = torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype)
    for start in range(0, x.shape[1], 256):
        out = out + x[:, start : start + 256] @ weight[:, start : start + 256].T
    return out + bias


@numalign.candidate("linear", name="wrong_dropped_tail")
def linear_dropped_tail(x, weight, bias):
    """Processes K in tiles of 64 and drops the last partial tile."""
    k = x.shape[1] // 64 * 64 if x.shape[1] >= 64 else x.shape[1]
    return linear.linear_reference(x[:, :k], weight[:, :k], bias)


@numalign.candidate("moe_routing", name="wrong_no_renorm")
def routing_no_renorm(logits, bias, top_k, scoring, renormalize, groups, topk_groups, scaling):
    """Forgets to renormalize the top-k weights."""
    from operators.moe import routing_reference

    return routing_reference(logits, bias, top_k, scoring, False, groups, topk_groups, scaling)


@numalign.candidate("paged_attention", name="wrong_page_offset")
def paged_wrong_offset(q, k, v, lengths):
    """Reads each page after the first one token late: right until a page boundary."""
    shifted = k.clone()
    if k.shape[1] > 16:
        shifted[:, 16:-1] = k[:, 17:]
    return paged_kv.paged_attention_reference(q, shifted, v, lengths)


@numalign.candidate("cumsum", name="wrong_chunk_carry")
def cumsum_no_carry(x):
    """A chunked scan that carries only the first chunk's total forward."""
    xf = up(x)
    out = torch.empty_like(xf)
    carry = torch.zeros_like(xf[..., :1])
    for i, start in enumerate(range(0, xf.shape[-1], 64)):
        block = xf[..., start : start + 64].cumsum(-1) + carry
        out[..., start : start + 64] = block
        if i == 0:
            carry = block[..., -1:]
    return out.to(x.dtype)


@numalign.candidate("gated_delta_rule", name="wrong_no_decay_across_chunks")
def delta_no_decay(q, k, v, g, beta):
    """Decays within a chunk but not the state carried between chunks."""
    from operators.linear_attention import gated_delta_rule_reference

    out = []
    for start in range(0, q.shape[2], 64):
        sl = slice(start, start + 64)
        out.append(
            gated_delta_rule_reference(
                q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl]
            )
        )
    return torch.cat(out, dim=2)


@numalign.candidate("layer_norm", name="wrong_one_pass_variance")
def layer_norm_one_pass(x, weight, bias, eps):
    """var = E[x^2] - E[x]^2 in the input dtype: cancels when the mean is large."""
    mean = x.mean(-1, keepdim=True)
    var = (x * x).mean(-1, keepdim=True) - mean * mean
    return (x - mean) * torch.rsqrt(var.clamp_min(0) + eps) * weight + bias


@numalign.candidate("attention", name="wrong_window_off_by_one")
def attention_window_off_by_one(q, k, v, causal, window, softcap, scale, pad_left):
    """Sliding window that keeps one key too many."""
    return attention.attention_reference(
        q, k, v, causal, window + 1 if window is not None else None, softcap, scale, pad_left
    )


@numalign.candidate("topk", name="wrong_smallest")
def topk_smallest(x, k):
    """Selects the smallest values."""
    result = torch.topk(x, k, dim=-1, largest=False, sorted=True)
    return result.values.flip(-1), result.indices.flip(-1)


@numalign.candidate("softplus", name="wrong_no_threshold")
def softplus_no_threshold(x):
    """log(1 + exp(x)) with no threshold, in the input dtype: exp overflows on large gates."""
    return torch.log1p(torch.exp(x))


# --- correct but different kernels: must pass in every dtype --------------------------------
@numalign.candidate("rms_norm", name="right_divide")
def rms_divide(x, weight, eps, offset=0.0):
    """Divides by the root instead of multiplying by its reciprocal."""
    xf = up(x)
    return (xf / torch.sqrt(xf.square().mean(-1, keepdim=True) + eps) * (offset + up(weight))).to(
        x.dtype
    )


@numalign.candidate("softmax", name="right_log_softmax")
def softmax_via_log(x, mask):
    """exp(log_softmax): another reduction order."""
    out = torch.exp(torch.log_softmax(up(x).masked_fill(mask, -math.inf), dim=-1))
    return out.nan_to_num(0.0).to(x.dtype)


@numalign.candidate("attention", name="right_math")
def attention_math(q, k, v, causal, window, softcap, scale, pad_left):
    """Plain float32 math with the GQA heads expanded by repeat_interleave."""
    return _attend(q, k, v, scale, softcap, window, pad_left, shift=0 if causal else NO_CAUSAL)


# ==== the grid gaps ===================================================================


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


# ==== the operators of the newest models ==============================================


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
    mask = attention.attention_mask(t, s, causal, None, pad_left)
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
    mask = attention.attention_mask(t, k.shape[2], causal, window, pad_left)
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
