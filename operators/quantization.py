"""Quantization: symmetric per-row int8 and per-tensor float8 (E4M3) quantize and dequantize.

Quantizers return their values and their scale in the input dtype, and quantize with the
scale they return (so q * scale is within half a step of x). Quantized values are judged by
their rounding (``kind="quantized"``, see ``numalign.ops.registry.RoundingRule``), read in their
declared format (``CodeLayout``: int8, float8_e4m3fn): the round trip against the float64
truth with the candidate's own scale, the share of elements rounded to the farther
neighbour, and the bias; the scale is judged as a float output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from numalign.ops.cases import Case, values
from numalign.ops.registry import CodeLayout, Operator, Output, candidate, register_operator
from operators._common import tier_cases, up

INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn

QUANT_CASES = tier_cases(
    Case("one-1x1", {"tokens": 1, "hidden": 1}),
    Case("rows-8x4096", {"tokens": 8, "hidden": 4096}),
    Case("outliers-16x4096", {"tokens": 16, "hidden": 4096}, regime="outliers"),
    Case("small-4x1000", {"tokens": 4, "hidden": 1000}, regime="small"),
    Case("unaligned-33x4097", {"tokens": 33, "hidden": 4097}),
    Case("zeros-row-3x64", {"tokens": 3, "hidden": 64, "zero_row": True}, tier="pr"),
    Case("many-4096x4096", {"tokens": 4096, "hidden": 4096}, tier="nightly"),
)


def quant_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    x = values((case["tokens"], case["hidden"]), case.regime, gen)
    if case.get("zero_row"):
        x[1] = 0.0  # an all-zero row: the scale must not divide by zero
    return {"x": x}


def _row_scale(x: torch.Tensor) -> torch.Tensor:
    absmax = up(x).abs().amax(-1, keepdim=True)
    return torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))


def quantize_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., hidden] -> (q int8 [..., hidden], scale [..., 1] in x's dtype): scale =
    max|x| / 127 per row (1 for an all-zero row), rounded to x's dtype, and q = round(x /
    scale) with that stored scale (ties to even)."""
    scale = _row_scale(x).to(x.dtype)
    q = torch.round(up(x) / up(scale)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


register_operator(
    Operator(
        name="quantize_int8",
        op_class="quantization",
        reference=quantize_int8_reference,
        make_inputs=quant_inputs,
        cases=QUANT_CASES,
        outputs=(
            Output(
                "q",
                kind="quantized",
                quantized_from="x",
                scale_from="scale",
                layout=CodeLayout("int8"),
            ),
            Output("scale"),
        ),
        description="symmetric per-row int8 quantization",
    )
)


@candidate("quantize_int8", name="reciprocal")
def quantize_int8_reciprocal(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Multiplies by the reciprocal of the stored scale (one per row), as vectorized kernels
    do."""
    absmax = up(x).abs().amax(-1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax)).to(x.dtype)
    q = torch.round(up(x) * (1.0 / up(scale))).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequant_inputs(
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> Callable[[Case, torch.Generator], dict[str, Any]]:
    """Inputs of a dequantizer: the case's values quantized by the reference quantizer."""

    def make(case: Case, gen: torch.Generator) -> dict[str, Any]:
        q, scale = quantize(quant_inputs(case, gen)["x"])
        return {"q": q, "scale": scale}

    return make


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantized values (int8 or float8) times their scale, in float32."""
    return (q.to(up(scale).dtype) * up(scale)).to(scale.dtype)


register_operator(
    Operator(
        name="dequantize_int8",
        op_class="quantization",
        reference=dequantize_reference,
        make_inputs=dequant_inputs(quantize_int8_reference),
        cases=QUANT_CASES,
        description="int8 values times their row scale",
    )
)


@candidate("dequantize_int8", name="torch")
def dequantize_int8_torch(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Straight in the output dtype, as an unfused model does."""
    return q.to(scale.dtype) * scale


def _tensor_scale(x: torch.Tensor) -> torch.Tensor:
    absmax = up(x).abs().amax()
    return torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))


def quantize_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [...] -> (q float8_e4m3fn [...], scale [] in x's dtype): scale = max|x| / 448,
    rounded to x's dtype; q = x / scale rounded to float8_e4m3fn (saturating at 448)."""
    scale = _tensor_scale(x).to(x.dtype)
    q = (up(x) / up(scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


register_operator(
    Operator(
        name="quantize_fp8",
        op_class="quantization",
        reference=quantize_fp8_reference,
        make_inputs=quant_inputs,
        cases=QUANT_CASES,
        outputs=(
            Output(
                "q",
                kind="quantized",
                quantized_from="x",
                scale_from="scale",
                layout=CodeLayout("float8_e4m3fn"),
            ),
            Output("scale"),
        ),
        description="per-tensor float8 E4M3 quantization",
    )
)


@candidate("quantize_fp8", name="reciprocal")
def quantize_fp8_reciprocal(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Multiplies by the reciprocal of the stored scale."""
    scale = _tensor_scale(x).to(x.dtype)
    q = (up(x) * (1.0 / up(scale))).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


register_operator(
    Operator(
        name="dequantize_fp8",
        op_class="quantization",
        reference=dequantize_reference,
        make_inputs=dequant_inputs(quantize_fp8_reference),
        cases=QUANT_CASES,
        description="float8 E4M3 values times the tensor scale",
    )
)


@candidate("dequantize_fp8", name="torch")
def dequantize_fp8_torch(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (q.float() * scale.float()).to(scale.dtype)
