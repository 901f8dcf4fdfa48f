"""Linear layers and batched matmul: float32 accumulation over K."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, candidate, register_operator
from operators._common import tier_cases, up
from operators._tiles import tile_products, tiles

LINEAR_CASES = tier_cases(
    Case("one-1x1x1", {"tokens": 1, "k": 1, "n": 1}),
    Case("small-4x64x32", {"tokens": 4, "k": 64, "n": 32}, regime="small"),
    Case("unaligned-7x4097x33", {"tokens": 7, "k": 4097, "n": 33}),
    Case("outliers-16x1024x96", {"tokens": 16, "k": 1024, "n": 96}, regime="outliers"),
    Case("noncontig-5x200x24", {"tokens": 5, "k": 200, "n": 24, "noncontiguous": True}),
    Case("llm-8x4096x4096", {"tokens": 8, "k": 4096, "n": 4096}, tier="pr"),
    Case("large-k-2x32768x8", {"tokens": 2, "k": 32768, "n": 8}),
    Case("empty-0x64x16", {"tokens": 0, "k": 64, "n": 16}, tier="pr"),
    Case("llm-128x4096x11008", {"tokens": 128, "k": 4096, "n": 11008}, tier="nightly"),
)


def linear_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    k = case["k"]
    return {
        "x": values((case["tokens"], k), case.regime, gen),
        # Weights scaled by 1/sqrt(K), as trained layers keep activations of order 1.
        "weight": values((case["n"], k), "ordinary", gen) / k**0.5,
        "bias": values((case["n"],), "ordinary", gen) * 0.1,
    }


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out = up(x) @ up(weight).T
    if bias is not None:
        out = out + up(bias)
    return out.to(x.dtype)


register_operator(
    Operator(
        name="linear",
        aten=("mm", "addmm", "linear"),
        probe_swap=True,
        op_class="matmul",
        reference=linear_reference,
        make_inputs=linear_inputs,
        cases=LINEAR_CASES,
        reduction_length=lambda case: case["k"],
        hf_modules=("Linear",),
        adapter=lambda m: {"weight": m.weight, "bias": m.bias},
        description="y = x W^T + b, float32 accumulation",
    )
)


@candidate("linear", name="torch")
def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


#: K-slices of the split-K candidate: a tile width a GPU kernel would use.
SPLIT_K = 256


@candidate("linear", name="split_k")
def linear_split_k(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Split-K: one float32 partial product per slice of K (a split-K kernel's thread
    blocks), then the partials summed in float32."""
    out = tile_products(up(x), up(weight), SPLIT_K).sum(0)
    if bias is not None:
        out += up(bias)
    return out.to(x.dtype)


MATMUL_CASES = tier_cases(
    Case("one-1x1x1x1", {"batch": 1, "m": 1, "k": 1, "n": 1}),
    Case("batched-3x17x64x9", {"batch": 3, "m": 17, "k": 64, "n": 9}),
    Case("unaligned-2x31x1023x65", {"batch": 2, "m": 31, "k": 1023, "n": 65}),
    Case("large-2x8x256x8", {"batch": 2, "m": 8, "k": 256, "n": 8}, regime="large"),
    Case("heads-32x64x128x64", {"batch": 32, "m": 64, "k": 128, "n": 64}, tier="pr"),
    Case(
        "noncontig-4x33x100x7",
        {"batch": 4, "m": 33, "k": 100, "n": 7, "noncontiguous": True},
        tier="pr",
    ),
    # K of a hidden size and beyond: low-precision accumulators drift as sqrt(K).
    Case("large-k-2x8x4096x8", {"batch": 2, "m": 8, "k": 4096, "n": 8}, tier="pr"),
    Case("long-k-1x4x16384x4", {"batch": 1, "m": 4, "k": 16384, "n": 4}, tier="pr"),
    # Partial sums climb to RANGE_PEAK (near float16's 65504) and cancel back: a float16
    # accumulator loses whole units there (spacing 32) in every input dtype, bfloat16 too.
    Case("range-1x8x4096x8", {"batch": 1, "m": 8, "k": 4096, "n": 8, "range": True}),
    Case("long-k-1x4x131072x4", {"batch": 1, "m": 4, "k": 131072, "n": 4}, tier="nightly"),
)
#: Where the partial sums of the "range" case peak: 78% of float16's largest finite value
#: (65504), so they approach its range without overflowing the output.
RANGE_PEAK = 51200.0


def matmul_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """a [batch, m, k] in the case's regime, b [batch, k, n] scaled by 1/sqrt(k); the "range"
    case draws a = +-(c + noise) (+ over the first half of K, - over the second) and
    b = c + noise with c * c * k / 2 = RANGE_PEAK (noise 0.1 c N(0, 1)), so partial sums rise
    to RANGE_PEAK and cancel to about 0.1 c**2 sqrt(2 k), a few hundred."""
    b, m, k, n = case["batch"], case["m"], case["k"], case["n"]
    if case.get("range"):
        c = (2 * RANGE_PEAK / k) ** 0.5
        sign = torch.where(torch.arange(k) < k // 2, 1.0, -1.0).to(torch.float64)
        a = sign * (c + 0.1 * c * values((b, m, k), "ordinary", gen))
        return {"a": a, "b": c + 0.1 * c * values((b, k, n), "ordinary", gen)}
    return {
        "a": values((b, m, k), case.regime, gen),
        "b": values((b, k, n), "ordinary", gen) / k**0.5,
    }


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(up(a), up(b)).to(a.dtype)


register_operator(
    Operator(
        name="matmul",
        aten=("mm", "bmm", "matmul", "baddbmm"),
        op_class="matmul",
        reference=matmul_reference,
        make_inputs=matmul_inputs,
        cases=MATMUL_CASES,
        reduction_length=lambda case: case["k"],
        description="batched a @ b, float32 accumulation",
    )
)


@candidate("matmul", name="torch")
def matmul_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


#: K tile of the tiled candidate.
TILE = 64


@candidate("matmul", name="tiled")
def matmul_tiled(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """K in tiles of 64: each tile's product in float32 (a tiled kernel's inner step), the
    tiles' products summed in float32, then rounded once to the output dtype."""
    at = tiles(up(a), TILE).transpose(1, 2)  # [batch, k tiles, m, TILE]
    bt = tiles(up(b).transpose(-1, -2), TILE).permute(0, 2, 3, 1)  # [batch, k tiles, TILE, n]
    return (at @ bt).sum(1).to(a.dtype)
