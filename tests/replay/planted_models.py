"""Planted model bugs (and one honest swap) as candidates: the model-suite tests and
``bench/bench_separation.py`` swap them into the zoo with ``--candidates planted_models``."""

import torch

import numalign
from operators._common import up
from operators.norms import rms_norm_reference


@numalign.candidate("rms_norm", name="bad_eps")
def bad_eps(x, weight, eps, offset=0.0):
    """An epsilon of 1e-2 where the model says 1e-6: fine for large inputs, not here."""
    return rms_norm_reference(x, weight, 1e-2, offset)


@numalign.candidate("rope_tables", name="bad_interleaved")
def bad_interleaved(x, cos, sin):
    """GPT-J's interleaved pairs where the model rotates halves."""
    xf = up(x)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    c, s = up(cos)[..., : x.shape[-1] // 2], up(sin)[..., : x.shape[-1] // 2]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)


@numalign.candidate("rms_norm", name="scaled_1pct")
def scaled_1pct(x, weight, eps, offset=0.0):
    """An RMSNorm whose output is 1% too large: within bfloat16's max-abs budget at most
    elements, a systematic scale all the same."""
    return (up(rms_norm_reference(x, weight, eps, offset)) * 1.01).to(x.dtype)


@numalign.candidate("rms_norm", name="good_fused")
def good_fused(x, weight, eps, offset=0.0):
    xf = up(x)
    inv = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * inv * (offset + up(weight))).to(x.dtype)


@numalign.candidate("rms_norm", name="scaled_03pct")
def scaled_03pct(x, weight, eps, offset=0.0):
    """An RMSNorm whose output is 0.3% too large: under one bfloat16 rounding (0.39%) at every
    element, so only a lean pooled over many elements resolves it."""
    return (up(rms_norm_reference(x, weight, eps, offset)) * 1.003).to(x.dtype)
