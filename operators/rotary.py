"""Rotary position embeddings: NeoX half rotation, GPT-J interleaved, partial rotary, and the
multimodal M-RoPE of Qwen2-VL (frequency sections per temporal, height and width position)."""

from __future__ import annotations

from typing import Any

import torch

from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, candidate, register_operator
from operators._common import tier_cases, up

ROPE_CASES = tier_cases(
    Case("one-1x1x1x2", {"batch": 1, "heads": 1, "tokens": 1, "dim": 2}),
    Case("small-1x4x17x64", {"batch": 1, "heads": 4, "tokens": 17, "dim": 64}),
    Case("llm-1x32x64x128", {"batch": 1, "heads": 32, "tokens": 64, "dim": 128}),
    Case("far-2x2x8x128", {"batch": 2, "heads": 2, "tokens": 8, "dim": 128, "offset": 32760}),
    Case(
        "outliers-1x8x33x128",
        {"batch": 1, "heads": 8, "tokens": 33, "dim": 128},
        regime="outliers",
        tier="pr",
    ),
    Case(
        "noncontig-2x3x9x64",
        {"batch": 2, "heads": 3, "tokens": 9, "dim": 64, "noncontiguous": True},
        tier="pr",
    ),
    Case("long-1x2x32768x64", {"batch": 1, "heads": 2, "tokens": 32768, "dim": 64}, tier="pr"),
    Case(
        "long-1x1x131072x128",
        {"batch": 1, "heads": 1, "tokens": 131072, "dim": 128},
        tier="nightly",
    ),
)
#: RoPE base of Llama 3 and Qwen2 checkpoints.
THETA = 500000.0
#: Partial rotary: the fraction of each head rotated (GPT-NeoX, Phi, GLM use 0.25-0.5).
PARTIAL_FRACTION = 0.5
#: M-RoPE sections (temporal, height, width) in halves of head_dim 128, as in Qwen2-VL.
MROPE_SECTIONS = (16, 24, 24)


def rotary_dim(head_dim: int) -> int:
    """The rotated part of a head under partial rotary: an even number of channels."""
    return int(head_dim * PARTIAL_FRACTION) // 2 * 2


def _positions(case: Case) -> torch.Tensor:
    return torch.arange(case.get("offset", 0), case.get("offset", 0) + case["tokens"])


def rope_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    shape = (case["batch"], case["heads"], case["tokens"], case["dim"])
    return {"x": values(shape, case.regime, gen), "positions": _positions(case), "theta": THETA}


def _angles(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype) -> torch.Tensor:
    """positions x inverse frequencies, in the accumulation dtype: [tokens, dim // 2]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return positions.to(dtype)[:, None] * inv_freq.to(dtype)[None, :]


def _rotate_neox(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotate_gptj(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rope_neox_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    xf = up(x)
    return _rotate_neox(xf, _angles(positions.to(x.device), x.shape[-1], theta, xf.dtype)).to(
        x.dtype
    )


def rope_gptj_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    xf = up(x)
    return _rotate_gptj(xf, _angles(positions.to(x.device), x.shape[-1], theta, xf.dtype)).to(
        x.dtype
    )


def rope_partial_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotation of the first half of each head; the rest passes through."""
    xf = up(x)
    rot = rotary_dim(x.shape[-1])
    angles = _angles(positions.to(x.device), rot, theta, xf.dtype)
    return torch.cat((_rotate_neox(xf[..., :rot], angles), xf[..., rot:]), dim=-1).to(x.dtype)


def mrope_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    inputs = rope_inputs(case, gen)
    t = case["tokens"]
    # Text tokens share one position on all three axes; the middle third is an image grid
    # whose height and width positions differ from its temporal one.
    pos = _positions(case).repeat(3, 1)
    grid = torch.arange(t // 3, 2 * (t // 3))
    side = max(1, int(len(grid) ** 0.5))
    if len(grid):
        pos[1, grid] = grid[0] + (grid - grid[0]) // side
        pos[2, grid] = grid[0] + (grid - grid[0]) % side
    inputs["positions"] = pos
    return inputs


def _mrope_angles(
    positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype
) -> torch.Tensor:
    """[tokens, dim // 2]: frequency i takes its position from the axis whose section holds i."""
    per_axis = torch.stack([_angles(p, dim, theta, dtype) for p in positions])  # [3, T, dim/2]
    scale = (dim // 2) / sum(MROPE_SECTIONS)
    bounds = [round(s * scale) for s in MROPE_SECTIONS]
    bounds[-1] = dim // 2 - sum(bounds[:-1])
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor(bounds))
    return per_axis.gather(
        0, axis.to(positions.device)[None, None, :].expand(1, per_axis.shape[1], -1)
    )[0]


def mrope_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    xf = up(x)
    angles = _mrope_angles(positions.to(x.device), x.shape[-1], theta, xf.dtype)
    return _rotate_neox(xf, angles).to(x.dtype)


for _name, _ref, _inputs, _doc in (
    ("rope_neox", rope_neox_reference, rope_inputs, "rotary, NeoX half rotation (Llama, Qwen)"),
    ("rope_gptj", rope_gptj_reference, rope_inputs, "rotary, GPT-J interleaved pairs"),
    ("rope_partial", rope_partial_reference, rope_inputs, "rotary on the first half of each head"),
    ("mrope", mrope_reference, mrope_inputs, "multimodal M-RoPE sections (Qwen2-VL)"),
):
    register_operator(
        Operator(
            name=_name,
            op_class="elementwise",
            reference=_ref,
            make_inputs=_inputs,
            cases=ROPE_CASES,
            description=_doc,
            hf_modules=("*RotaryEmbedding",) if _name == "rope_neox" else (),
            # a rotary computed inline (no rotary module) shows as its cos and sin tables
            aten=("cos", "sin") if _name == "rope_neox" else (),
        )
    )


def _complex_rotate(pairs: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotation as a complex product: (a + ib) e^{i angle}."""
    z = torch.view_as_complex(pairs.contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles))


@candidate("rope_neox", name="complex")
def rope_neox_complex(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    xf, half = up(x), x.shape[-1] // 2
    angles = _angles(positions.to(x.device), x.shape[-1], theta, xf.dtype)
    rotated = _complex_rotate(torch.stack((xf[..., :half], xf[..., half:]), dim=-1), angles)
    return torch.cat((rotated[..., 0], rotated[..., 1]), dim=-1).to(x.dtype)


@candidate("rope_neox", name="cached")
def rope_neox_cached(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF style: cos and sin tables duplicated to the full head, rotate_half, in the dtype of
    x after float32 tables (as transformers' Llama does)."""
    angles = _angles(positions.to(x.device), x.shape[-1], theta, up(x).dtype)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    half = x.shape[-1] // 2
    rotated = torch.cat((-up(x)[..., half:], up(x)[..., :half]), dim=-1)
    return (up(x) * cos + rotated * sin).to(x.dtype)


@candidate("rope_gptj", name="complex")
def rope_gptj_complex(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    xf = up(x)
    angles = _angles(positions.to(x.device), x.shape[-1], theta, xf.dtype)
    pairs = xf.reshape(*xf.shape[:-1], -1, 2)
    return _complex_rotate(pairs, angles).flatten(-2).to(x.dtype)


@candidate("rope_partial", name="complex")
def rope_partial_complex(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    rot = rotary_dim(x.shape[-1])
    rotated = rope_neox_complex(x[..., :rot], positions, theta)
    return torch.cat((rotated, x[..., rot:]), dim=-1)


@candidate("mrope", name="per_section")
def mrope_per_section(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Each section's frequencies rotated by its own axis' positions, then concatenated."""
    xf, dim = up(x), x.shape[-1]
    angles = _angles(positions.to(x.device)[0], dim, theta, xf.dtype).clone()
    scale = (dim // 2) / sum(MROPE_SECTIONS)
    start = 0
    for axis, size in enumerate(MROPE_SECTIONS):
        size = round(size * scale) if axis < 2 else dim // 2 - start
        axis_angles = _angles(positions.to(x.device)[axis], dim, theta, xf.dtype)
        angles[:, start : start + size] = axis_angles[:, start : start + size]
        start += size
    return rope_neox_complex_angles(xf, angles).to(x.dtype)


def rope_neox_complex_angles(xf: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    half = xf.shape[-1] // 2
    rotated = _complex_rotate(torch.stack((xf[..., :half], xf[..., half:]), dim=-1), angles)
    return torch.cat((rotated[..., 0], rotated[..., 1]), dim=-1)


# -- rotary from cos/sin tables: what transformers' apply_rotary_pos_emb does ------------------
def rope_tables_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """x [batch, heads, tokens, dim] and HF-style tables [batch, 1, tokens, dim] (each angle
    twice: the two halves rotate together)."""
    x = values((case["batch"], case["heads"], case["tokens"], case["dim"]), case.regime, gen)
    angles = _angles(_positions(case), case["dim"], THETA, torch.float64)
    emb = torch.cat((angles, angles), dim=-1)[None, None].expand(case["batch"], 1, -1, -1)
    return {"x": x, "cos": emb.cos(), "sin": emb.sin()}


def rope_tables_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1) over the two halves."""
    xf, half = up(x), x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * up(cos) + rotated * up(sin)).to(x.dtype)


def _rope_function_adapter(candidate_fn: Any, original: Any) -> Any:
    """A drop-in for transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``
    that rotates q and k with the candidate."""
    import inspect

    signature = inspect.signature(original)

    def apply_rotary_pos_emb(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        dim = a.get("unsqueeze_dim", 1)
        cos, sin = a["cos"].unsqueeze(dim), a["sin"].unsqueeze(dim)
        return candidate_fn(x=a["q"], cos=cos, sin=sin), candidate_fn(x=a["k"], cos=cos, sin=sin)

    return apply_rotary_pos_emb


register_operator(
    Operator(
        name="rope_tables",
        op_class="elementwise",
        reference=rope_tables_reference,
        make_inputs=rope_tables_inputs,
        cases=ROPE_CASES,
        description="rotary from cos/sin tables (transformers' apply_rotary_pos_emb)",
        hf_functions=("apply_rotary_pos_emb",),
        function_adapter=_rope_function_adapter,
    )
)


@candidate("rope_tables", name="complex")
def rope_tables_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The halves as complex numbers times cos + i sin."""
    xf, half = up(x), x.shape[-1] // 2
    z = torch.complex(xf[..., :half], xf[..., half:])
    w = torch.complex(up(cos)[..., :half], up(sin)[..., :half])
    rotated = z * w
    return torch.cat((rotated.real, rotated.imag), dim=-1).to(x.dtype)
