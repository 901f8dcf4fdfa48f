"""A vendor's kernel module, as it would live outside numalign: deliberately wrong kernels of
realistic kinds (each must fail the suite, naming its operator and a case that exposes it)
and correct but different ones (each must pass in every dtype).

The test copies this file out of the repository and names it with --candidates.
"""

from __future__ import annotations

import math

import torch

import numalign
from operators import attention, linear, norms, paged_kv

up = norms.up


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
