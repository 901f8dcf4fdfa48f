"""Scaled rotary embeddings of current long-context checkpoints (transformers' ``rope_type``):
linear position interpolation, dynamic NTK, YaRN (Qwen2.5, DeepSeek) and Llama 3.1's
frequency-dependent scaling, all NeoX half rotation, checked at positions beyond the
original context.

``rope`` is the checkpoint's rope-scaling dict as its config.json spells it (``rope_type``,
``factor``, ``original_max_position_embeddings`` and the variant's own keys). The inverse
frequencies are constants of the model and computed in float64; the angles (position x
inverse frequency) and the rotation are computed in the accumulation dtype, as
``*RotaryEmbedding`` modules compute them in float32. YaRN's attention factor scales cos and
sin. ``*RotaryEmbedding.forward(x, position_ids)`` computes these tables; its module is
mapped here, but a swap would need both of its inputs (the replay's swapped module passes
only the first), so it has no adapter."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, candidate, register_operator
from operators._common import tier_cases, up

#: The rope-scaling dicts of current checkpoints (shortened contexts keep the cases small:
#: each is checked from below to beyond its original_max_position_embeddings).
ROPE_SCALINGS: Mapping[str, Mapping[str, Any]] = {
    # Code Llama-style linear interpolation: positions divided by the factor.
    "linear": {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 4096},
    # Dynamic NTK: the base grows with the sequence once it passes the original context.
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4096},
    # Qwen2.5's YaRN (factor 4 over 32768), beta_fast 32 and beta_slow 1 as transformers'.
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    # Llama 3.1's config.json.
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
#: The base of each variant's checkpoints (Llama 2: 1e4; Qwen2.5: 1e6; Llama 3.1: 5e5).
THETAS: Mapping[str, float] = {"linear": 1e4, "dynamic": 1e4, "yarn": 1e6, "llama3": 5e5}


def _case(
    kind: str, shape: tuple[int, int, int, int], start: int, tier: str = "smoke", **extra: Any
) -> Case:
    b, h, t, d = shape
    name = f"{kind}-{'x'.join(map(str, shape))}-at{start}"
    regime = extra.pop("regime", "ordinary")
    params = {"batch": b, "heads": h, "tokens": t, "dim": d, "start": start, "kind": kind}
    return Case(name, params | extra, regime=regime, tier=tier)


ROPE_SCALING_CASES = tier_cases(
    _case("linear", (1, 1, 1, 2), 0),
    # past the original context: 4x (linear), 2.5x (dynamic), 3x (yarn), 12x (llama3)
    _case("linear", (1, 4, 17, 128), 16000),
    _case("dynamic", (1, 4, 17, 128), 10000),
    _case("yarn", (1, 4, 17, 128), 100000),
    _case("llama3", (1, 4, 17, 128), 100000),
    # across the original context, from below it to beyond it
    _case("dynamic", (1, 2, 4096, 64), 2048, tier="pr"),
    _case("yarn", (1, 2, 2048, 128), 31744, tier="pr"),
    _case("llama3", (1, 2, 2048, 128), 7168, tier="pr"),
    _case("linear", (2, 3, 33, 80), 20000, tier="pr", noncontiguous=True),
    _case("yarn", (1, 8, 33, 128), 131000, tier="pr", regime="outliers"),
    _case("llama3", (1, 2, 0, 64), 9000, tier="pr"),
    _case("llama3", (1, 1, 131072, 128), 0, tier="nightly"),
)


def rope_scaling_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """x [batch, heads, tokens, dim]; positions [tokens] from ``start``; theta; rope."""
    shape = (case["batch"], case["heads"], case["tokens"], case["dim"])
    kind = case["kind"]
    return {
        "x": values(shape, case.regime, gen),
        "positions": torch.arange(case["start"], case["start"] + case["tokens"]),
        "theta": THETAS[kind],
        "rope": dict(ROPE_SCALINGS[kind]),
    }


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def _yarn(dim: int, theta: float, rope: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """Frequencies above beta_fast rotations over the original context keep their value,
    those below beta_slow are divided by the factor, a linear ramp between (in frequency
    index); cos and sin are scaled by 0.1 ln(factor) + 1."""
    factor, original = float(rope["factor"]), int(rope["original_max_position_embeddings"])
    fast, slow = float(rope.get("beta_fast", 32.0)), float(rope.get("beta_slow", 1.0))

    def index_of(rotations: float) -> float:
        """The frequency index that turns ``rotations`` times over the original context."""
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(index_of(fast)), 0)
    high = min(math.ceil(index_of(slow)), dim - 1)
    span = (high - low) or 1e-3  # equal ends: a step instead of a ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / span).clamp(0.0, 1.0)
    base = _default_inv_freq(dim, theta)
    inv_freq = base / factor * ramp + base * (1.0 - ramp)
    attention = float(rope.get("attention_factor") or (0.1 * math.log(factor) + 1.0))
    return inv_freq, attention if factor > 1 else 1.0


def _llama3(dim: int, theta: float, rope: Mapping[str, Any]) -> torch.Tensor:
    """Wavelengths longer than original / low_freq_factor are divided by the factor, shorter
    than original / high_freq_factor kept, and blended in between."""
    factor, original = float(rope["factor"]), int(rope["original_max_position_embeddings"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    base = _default_inv_freq(dim, theta)
    wavelength = 2 * math.pi / base
    smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    blended = base / factor * (1.0 - smooth) + base * smooth
    return torch.where(
        wavelength > original / low,
        base / factor,
        torch.where(wavelength < original / high, base, blended),
    )


def scaled_inv_freq(
    dim: int, theta: float, rope: Mapping[str, Any], seq_len: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim // 2] float64, attention factor) of a rope-scaling dict for
    a sequence of ``seq_len`` positions (dynamic NTK depends on it)."""
    kind = rope["rope_type"]
    if kind == "linear":
        return _default_inv_freq(dim, theta) / float(rope["factor"]), 1.0
    if kind == "dynamic":
        factor, original = float(rope["factor"]), int(rope["original_max_position_embeddings"])
        length = max(seq_len, original)
        grown = theta * (factor * length / original - (factor - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(dim, grown if dim > 2 else theta), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, rope)
    if kind == "llama3":
        return _llama3(dim, theta, rope), 1.0
    raise ValueError(f"unknown rope_type {kind!r}; known: linear, dynamic, yarn, llama3")


def _angles(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[tokens, dim // 2] in ``dtype``."""
    return positions.to(dtype)[:, None] * inv_freq.to(device=positions.device, dtype=dtype)


def rope_scaling_reference(
    x: torch.Tensor, positions: torch.Tensor, theta: float, rope: Mapping[str, Any]
) -> torch.Tensor:
    """NeoX rotation of x [batch, heads, tokens, dim] by the scaled angles, times the
    attention factor; same shape and dtype as x. The sequence length of dynamic NTK is the
    last position + 1."""
    xf = up(x)
    seq_len = int(positions.max()) + 1 if positions.numel() else 0
    inv_freq, attention = scaled_inv_freq(x.shape[-1], theta, rope, seq_len)
    angles = _angles(positions.to(x.device), inv_freq, xf.dtype)
    cos, sin = angles.cos() * attention, angles.sin() * attention
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


register_operator(
    Operator(
        name="rope_scaled",
        op_class="elementwise",
        reference=rope_scaling_reference,
        make_inputs=rope_scaling_inputs,
        cases=ROPE_SCALING_CASES,
        hf_modules=("*RotaryEmbedding",),
        # a rotary embedding is scaled only where its config names a scaling (rope_type)
        hf_module_check=lambda m: getattr(m, "rope_type", "default") != "default",
        description="scaled rotary (linear, dynamic NTK, YaRN, Llama 3.1) beyond the context",
    )
)


@candidate("rope_scaled", name="tables")
def rope_scaled_tables(
    x: torch.Tensor, positions: torch.Tensor, theta: float, rope: Mapping[str, Any]
) -> torch.Tensor:
    """transformers' way: float32 cos and sin tables over the full head (each angle twice),
    scaled by the attention factor, then x cos + rotate_half(x) sin."""
    seq_len = int(positions.max()) + 1 if positions.numel() else 0
    inv_freq, attention = scaled_inv_freq(x.shape[-1], theta, rope, seq_len)
    angles = _angles(positions.to(x.device), inv_freq, up(x).dtype)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos() * attention, emb.sin() * attention
    half = x.shape[-1] // 2
    rotated = torch.cat((-up(x)[..., half:], up(x)[..., :half]), dim=-1)
    return (up(x) * cos + rotated * sin).to(x.dtype)


@candidate("rope_scaled", name="complex")
def rope_scaled_complex(
    x: torch.Tensor, positions: torch.Tensor, theta: float, rope: Mapping[str, Any]
) -> torch.Tensor:
    """The halves as complex numbers times attention * e^(i angle)."""
    seq_len = int(positions.max()) + 1 if positions.numel() else 0
    inv_freq, attention = scaled_inv_freq(x.shape[-1], theta, rope, seq_len)
    xf, half = up(x), x.shape[-1] // 2
    angles = _angles(positions.to(x.device), inv_freq, xf.dtype)
    z = torch.complex(xf[..., :half].contiguous(), xf[..., half:].contiguous())
    rotated = z * torch.polar(torch.full_like(angles, attention), angles)
    return torch.cat((rotated.real, rotated.imag), dim=-1).to(x.dtype)
