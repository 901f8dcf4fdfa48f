"""Block-scaled FP8 (DeepSeek-V3 style): float8 E4M3 values with one float scale per block,
128x128 blocks for weights and 1x128 groups for activations.

- ``fp8_block_quant``: x [rows, cols] -> (codes [rows, cols] uint8, scale [ceil(rows/br),
  ceil(cols/bc)] float32), scale = max|block| / 448 (1 for an all-zero block, as transformers'
  ``Fp8Quantize`` keeps zeros stable), codes = x / scale rounded to E4M3.
- ``fp8_block_dequant``: codes and block scales -> values in the scales' dtype.
- ``fp8_block_gemm``: activations quantized in 1x128 groups times weights quantized in 128x128
  blocks, transposed: out [m, n] = dequant(a) @ dequant(b)^T, float32 accumulation.

**Codes are uint8 bit patterns** (``q.view(torch.uint8)``, as vLLM stores FP8 caches): the
suite casts every floating input to the dtype under test, which would turn float8 storage into
wider floats, while integer inputs reach the candidate as they are. The quantizer's codes are
judged by their rounding (``kind="quantized"``, see ``numalign.ops.registry.RoundingRule``): read
as E4M3 (the declared ``CodeLayout``: bits of another format decode off the grid), scaled by
the candidate's own block scales over the declared blocks (1x128 or 128x128, the last block
of a dimension partial), measured in E4M3 steps against the float64 truth: the worst
element, the share rounded to the farther neighbour, the bias. So a kernel that truncates
fails, and one that decides ties otherwise (a reciprocal multiply, rounding half away from
zero) passes. The scales are compared against the control's error budget.

Scales as *inputs* (dequantize, GEMM) arrive in the dtype under test, like every floating
input; the truth sees exactly those rounded scales, so the comparison is sound, and a kernel
that reads float32 scales loses nothing by upcasting them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from numalign.ops.cases import Case, values
from numalign.ops.registry import CodeLayout, Operator, Output, candidate, register_operator
from operators._common import acc, tier_cases, up
from operators._tiles import tile_products

FP8_MAX = 448.0  # largest finite float8_e4m3fn
#: DeepSeek-V3's block edge: 128x128 weight blocks, 1x128 activation groups.
BLOCK = 128
ACT_BLOCK = (1, BLOCK)
WEIGHT_BLOCK = (BLOCK, BLOCK)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def encode_fp8(y: torch.Tensor) -> torch.Tensor:
    """Scaled values -> E4M3 codes as uint8 bits (saturating at +-448, never NaN)."""
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_fp8(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 bits -> their E4M3 values in ``dtype`` (exact in every float dtype of the suite)."""
    return codes.view(torch.float8_e4m3fn).to(dtype)


def expand_scale(
    scale: torch.Tensor, shape: tuple[int, ...] | torch.Size, block: tuple[int, int]
) -> torch.Tensor:
    """Block scales [ceil(rows/br), ceil(cols/bc)] -> one per element, shape [rows, cols]."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| per block of x [rows, cols] (partial blocks at the edges), in ``acc(x)``."""
    rows, cols = x.shape
    br, bc = block
    nr, nc = _ceil(rows, br), _ceil(cols, bc)
    padded = F.pad(up(x).abs(), (0, nc * bc - cols, 0, nr * br - rows))
    return padded.reshape(nr, br, nc, bc).amax(dim=(1, 3))


def _block_scale(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    amax = block_amax(x, block)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def fp8_block_quant_reference(
    x: torch.Tensor, block_rows: int, block_cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (any float dtype) -> (codes uint8 [rows, cols], scale [ceil(rows /
    block_rows), ceil(cols / block_cols)] in float32, float64 for float64 inputs)."""
    block = (block_rows, block_cols)
    scale = _block_scale(x, block)
    codes = encode_fp8(up(x) / expand_scale(scale, x.shape, block))
    return codes, scale


def fp8_quant_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    rows, cols = case["rows"], case["cols"]
    x = values((rows, cols), case.regime, gen)
    if case["block"] == WEIGHT_BLOCK:
        x = x / math.sqrt(max(cols, 1))  # weights of a trained layer: order 1/sqrt(K)
    if case.get("zero_block"):
        x[: case["block"][0], : case["block"][1]] = 0.0  # the scale must not divide by zero
    return {"x": x, "block_rows": case["block"][0], "block_cols": case["block"][1]}


def _q(name: str, rows: int, cols: int, block: tuple[int, int], **kw: Any) -> Case:
    tier, regime = kw.pop("tier", "smoke"), kw.pop("regime", "ordinary")
    return Case(name, {"rows": rows, "cols": cols, "block": block, **kw}, regime, tier)


QUANT_CASES = tier_cases(
    _q("act-one-1x1", 1, 1, ACT_BLOCK),
    _q("act-8x4096", 8, 4096, ACT_BLOCK),
    _q("act-outliers-16x2048", 16, 2048, ACT_BLOCK, tier="pr", regime="outliers"),
    _q("weight-256x384", 256, 384, WEIGHT_BLOCK),
    _q("act-unaligned-33x4097", 33, 4097, ACT_BLOCK, tier="pr"),
    _q("act-small-4x1000", 4, 1000, ACT_BLOCK, tier="pr", regime="small"),
    _q("act-large-4x1000", 4, 1000, ACT_BLOCK, tier="pr", regime="large"),
    _q("act-zero-group-3x300", 3, 300, ACT_BLOCK, tier="pr", zero_block=True),
    _q("act-empty-0x4096", 0, 4096, ACT_BLOCK, tier="pr"),
    _q("act-noncontig-5x384", 5, 384, ACT_BLOCK, tier="pr", noncontiguous=True),
    _q("weight-unaligned-300x200", 300, 200, WEIGHT_BLOCK, tier="pr"),
    _q("weight-zero-block-256x256", 256, 256, WEIGHT_BLOCK, tier="pr", zero_block=True),
    _q("weight-outliers-128x1024", 128, 1024, WEIGHT_BLOCK, tier="pr", regime="outliers"),
    _q("act-deepseek-128x7168", 128, 7168, ACT_BLOCK, tier="nightly"),
    _q("weight-deepseek-2048x7168", 2048, 7168, WEIGHT_BLOCK, tier="nightly"),
)


def code_layout(case: Case) -> CodeLayout:
    """E4M3 codes, one scale per block of the case (1x128 or 128x128, partial at the edges)."""
    return CodeLayout("float8_e4m3fn", case["block"])


register_operator(
    Operator(
        name="fp8_block_quant",
        op_class="quantization",
        reference=fp8_block_quant_reference,
        make_inputs=fp8_quant_inputs,
        cases=QUANT_CASES,
        outputs=(
            Output(
                "q", kind="quantized", quantized_from="x", scale_from="scale", layout=code_layout
            ),
            Output("scale"),
        ),
        # transformers' FP8Linear quantizes its activations in 1x128 groups on every call
        hf_modules=("FP8Linear",),
        description="block-scaled float8 E4M3 quantization (1x128 groups, 128x128 blocks)",
    )
)


@candidate("fp8_block_quant", name="torch")
def fp8_block_quant_torch(
    x: torch.Tensor, block_rows: int, block_cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Straightforward: view as blocks, amax, divide, round (what DeepSeek's act_quant does)."""
    rows, cols = x.shape
    nr, nc = _ceil(rows, block_rows), _ceil(cols, block_cols)
    xf = F.pad(x.float(), (0, nc * block_cols - cols, 0, nr * block_rows - rows))
    blocks = xf.reshape(nr, block_rows, nc, block_cols)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    codes = q.view(torch.uint8).reshape(nr * block_rows, nc * block_cols)[:rows, :cols]
    return codes, scale.reshape(nr, nc).to(acc(x))


@candidate("fp8_block_quant", name="reciprocal")
def fp8_block_quant_reciprocal(
    x: torch.Tensor, block_rows: int, block_cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One reciprocal per block, then a multiply per element (vLLM's per-token-group
    quantizer): codes may then differ by one step where x / scale lands near a tie."""
    block = (block_rows, block_cols)
    amax = block_amax(x, block)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = encode_fp8(up(x) * expand_scale(1.0 / scale, x.shape, block))
    return codes, scale


# --- dequantize -----------------------------------------------------------------------------
def fp8_dequant_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """The case's values quantized by the reference (float64 scales, cast by the suite)."""
    made = fp8_quant_inputs(case, gen)
    codes, scale = fp8_block_quant_reference(**made)
    return {"q": codes, "scale": scale, "block_rows": made["block_rows"],
            "block_cols": made["block_cols"]}  # fmt: skip


def fp8_block_dequant_reference(
    q: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int
) -> torch.Tensor:
    """codes uint8 [rows, cols] and scale [ceil(rows/br), ceil(cols/bc)] -> values in the
    scale's dtype (the product taken in float32, float64 for float64 scales)."""
    full = expand_scale(up(scale), q.shape, (block_rows, block_cols))
    return (decode_fp8(q, full.dtype) * full).to(scale.dtype)


register_operator(
    Operator(
        name="fp8_block_dequant",
        op_class="quantization",
        reference=fp8_block_dequant_reference,
        make_inputs=fp8_dequant_inputs,
        cases=QUANT_CASES,
        description="block-scaled float8 E4M3 codes times their block scale",
    )
)


@candidate("fp8_block_dequant", name="torch")
def fp8_block_dequant_torch(
    q: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int
) -> torch.Tensor:
    """Straight in the output dtype, as an unfused model does."""
    full = expand_scale(scale, q.shape, (block_rows, block_cols))
    return decode_fp8(q, scale.dtype) * full


@candidate("fp8_block_dequant", name="blocked")
def fp8_block_dequant_blocked(
    q: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int
) -> torch.Tensor:
    """Whole blocks through a broadcast view (no expanded scale tensor), the ragged edge
    apart, as transformers' ``_dequantize_fp8_weight`` does."""
    rows, cols = q.shape
    out = decode_fp8(q, torch.float32)
    per_row = scale.float().repeat_interleave(block_rows, 0)[:rows]
    full, rem = divmod(cols, block_cols)
    if full:
        out[:, : full * block_cols].view(rows, full, block_cols).mul_(per_row[:, :full, None])
    if rem:
        out[:, full * block_cols :].mul_(per_row[:, full:])
    return out.to(scale.dtype)


# --- the block-scaled GEMM ------------------------------------------------------------------
def _g(name: str, m: int, k: int, n: int, **kw: Any) -> Case:
    tier, regime = kw.pop("tier", "smoke"), kw.pop("regime", "ordinary")
    return Case(name, {"m": m, "k": k, "n": n, **kw}, regime, tier)


GEMM_CASES = tier_cases(
    _g("one-1x1x1", 1, 1, 1),
    _g("blocks-4x512x256", 4, 512, 256),
    _g("unaligned-7x1000x300", 7, 1000, 300),
    _g("outliers-16x1024x128", 16, 1024, 128, tier="pr", regime="outliers"),
    _g("decode-1x1024x1536", 1, 1536, 1024, tier="pr"),
    _g("small-8x640x256", 8, 640, 256, tier="pr", regime="small"),
    _g("empty-0x256x128", 0, 256, 128, tier="pr"),
    _g("noncontig-5x384x200", 5, 384, 200, tier="pr", noncontiguous=True),
    _g("deepseek-64x7168x2048", 64, 7168, 2048, tier="nightly"),
)


def fp8_gemm_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    m, k, n = case["m"], case["k"], case["n"]
    a = values((m, k), case.regime, gen)
    b = values((n, k), "ordinary", gen) / math.sqrt(k)  # trained weights: order 1/sqrt(K)
    a_q, a_s = fp8_block_quant_reference(a, *ACT_BLOCK)
    b_q, b_s = fp8_block_quant_reference(b, *WEIGHT_BLOCK)
    return {"a": a_q, "a_scale": a_s, "b": b_q, "b_scale": b_s}


def fp8_block_gemm_reference(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> torch.Tensor:
    """a codes [m, k] with 1x128 scales [m, ceil(k/128)], b codes [n, k] with 128x128 scales
    [ceil(n/128), ceil(k/128)] -> a @ b^T [m, n] in the scales' dtype, float32 accumulation."""
    af = decode_fp8(a, acc(a_scale)) * expand_scale(up(a_scale), a.shape, ACT_BLOCK)
    bf = decode_fp8(b, acc(b_scale)) * expand_scale(up(b_scale), b.shape, WEIGHT_BLOCK)
    return (af @ bf.T).to(a_scale.dtype)


register_operator(
    Operator(
        name="fp8_block_gemm",
        op_class="matmul",
        reference=fp8_block_gemm_reference,
        make_inputs=fp8_gemm_inputs,
        cases=GEMM_CASES,
        reduction_length=lambda case: case["k"],
        # FP8Linear = dynamic 1x128 activation quantization, then this GEMM: not one to one
        # (the module takes unquantized activations), so no adapter.
        hf_modules=("FP8Linear",),
        description="1x128-group FP8 activations times 128x128-block FP8 weights, transposed",
    )
)


@candidate("fp8_block_gemm", name="dequant")
def fp8_block_gemm_dequant(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> torch.Tensor:
    """Dequantize both operands to float32, one F.linear (a fallback path)."""
    af = decode_fp8(a, torch.float32) * expand_scale(a_scale.float(), a.shape, ACT_BLOCK)
    bf = decode_fp8(b, torch.float32) * expand_scale(b_scale.float(), b.shape, WEIGHT_BLOCK)
    return F.linear(af, bf).to(a_scale.dtype)


@candidate("fp8_block_gemm", name="k_blocks")
def fp8_block_gemm_k_blocks(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> torch.Tensor:
    """DeepSeek's fp8_gemm: per K block, the product of the raw E4M3 values (exact in
    float32 accumulators), then scaled by a_scale[:, kb] * b_scale[n // 128, kb] and summed."""
    n = b.shape[0]
    # every K block's product at once: [k blocks, m, n]
    partials = tile_products(decode_fp8(a, torch.float32), decode_fp8(b, torch.float32), BLOCK)
    b_rows = b_scale.float().repeat_interleave(BLOCK, 0)[:n]  # [n, kb]
    scaled = partials * a_scale.float().T[:, :, None] * b_rows.T[:, None, :]
    return scaled.sum(0).to(a_scale.dtype)
