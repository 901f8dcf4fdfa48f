"""Activations (SiLU, GELU erf and tanh, softplus, SwiGLU, GeGLU) and masked softmax."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from numalign.compare import Budget
from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, candidate, register_operator
from operators._common import divide_or_zero, tier_cases, up
from operators._tiles import split_softmax

ACT_CASES = tier_cases(
    Case("one-1", {"shape": (1,)}),
    Case("tokens-8x4096", {"shape": (8, 4096)}),
    Case("large-4x1000", {"shape": (4, 1000)}, regime="large"),
    Case("small-4x1000", {"shape": (4, 1000)}, regime="small"),
    Case("unaligned-3x11009", {"shape": (3, 11009)}, tier="pr"),
    Case("noncontig-6x777", {"shape": (6, 777), "noncontiguous": True}, tier="pr"),
    Case("empty-0x16", {"shape": (0, 16)}, tier="pr"),
    Case("many-512x14336", {"shape": (512, 14336)}, tier="nightly"),
)


#: torch's float32 GELU (a vectorized erf) measured 4.2x-6.9x the control's worst error on
#: inputs near 1e-2 (4 ulp against 1: the control's 1 + erf rounds once there); 8x keeps a
#: margin and still fails a 2% error in bfloat16, whose control errs by half an ulp at most
#: (0.2%; 8 x 0.2% = 1.6%).
GELU_ERF_BUDGET = Budget(max_abs_multiplier=8.0)


def _x_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    return {"x": values(case["shape"], case.regime, gen)}


def _gated_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    return {
        "gate": values(case["shape"], case.regime, gen),
        "up": values(case["shape"], "ordinary", gen),
    }


def silu_reference(x: torch.Tensor) -> torch.Tensor:
    xf = up(x)
    return (xf / (1 + torch.exp(-xf))).to(x.dtype)


def gelu_erf_reference(x: torch.Tensor) -> torch.Tensor:
    xf = up(x)
    return (0.5 * xf * (1 + torch.erf(xf / math.sqrt(2.0)))).to(x.dtype)


def gelu_tanh_reference(x: torch.Tensor) -> torch.Tensor:
    xf = up(x)
    inner = math.sqrt(2.0 / math.pi) * (xf + 0.044715 * xf.pow(3))
    return (0.5 * xf * (1 + torch.tanh(inner))).to(x.dtype)


#: Where softplus returns its input (torch's default threshold: exp(20) makes 1 + exp(x)
#: exp(x) to float64's precision and beyond).
SOFTPLUS_THRESHOLD = 20.0


def softplus_reference(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), x itself above the threshold (the gates of Mamba's and the gated
    delta rule's time steps)."""
    xf = up(x)
    return torch.where(xf > SOFTPLUS_THRESHOLD, xf, torch.log1p(torch.exp(xf))).to(x.dtype)


def swiglu_reference(gate: torch.Tensor, up_: torch.Tensor) -> torch.Tensor:
    return (up(silu_reference(up(gate))) * up(up_)).to(gate.dtype)


def geglu_reference(gate: torch.Tensor, up_: torch.Tensor) -> torch.Tensor:
    return (up(gelu_tanh_reference(up(gate))) * up(up_)).to(gate.dtype)


def _gated(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def call(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return fn(gate, up)

    call.__name__ = fn.__name__
    return call


#: aten operators that stand for the activations where a model calls them as functions.
_ATEN: dict[str, tuple[str, ...]] = {
    "silu": ("silu",),
    "gelu_erf": ("gelu",),  # aten.gelu is exact unless approximate="tanh"
    "gelu_tanh": ("gelu(approximate=tanh)",),
    "softplus": ("softplus",),
}

for _name, _ref, _inputs, _modules, _doc in (
    ("silu", silu_reference, _x_inputs, ("SiLU*", "SiLUActivation"), "x * sigmoid(x)"),
    ("gelu_erf", gelu_erf_reference, _x_inputs, ("GELUActivation", "GELU"), "exact GELU (erf)"),
    (
        "gelu_tanh",
        gelu_tanh_reference,
        _x_inputs,
        ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh"),
        "tanh-approximate GELU",
    ),
    ("softplus", softplus_reference, _x_inputs, ("Softplus",), "log(1 + exp(x))"),
    ("swiglu", _gated(swiglu_reference), _gated_inputs, (), "silu(gate) * up"),
    ("geglu", _gated(geglu_reference), _gated_inputs, (), "gelu_tanh(gate) * up"),
):
    register_operator(
        Operator(
            name=_name,
            op_class="elementwise",
            reference=_ref,
            make_inputs=_inputs,
            cases=ACT_CASES,
            hf_modules=_modules,
            adapter=(lambda m: {}) if _modules else None,
            description=_doc,
            budget=GELU_ERF_BUDGET if _name == "gelu_erf" else None,
            aten=_ATEN.get(_name, ()),
        )
    )


@candidate("silu", name="torch")
def silu_torch(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


@candidate("silu", name="sigmoid")
def silu_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return (up(x) * torch.sigmoid(up(x))).to(x.dtype)


@candidate("gelu_erf", name="torch")
def gelu_erf_torch(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


@candidate("gelu_erf", name="erfc")
def gelu_erf_erfc(x: torch.Tensor) -> torch.Tensor:
    """0.5 x erfc(-x / sqrt 2): accurate for large negative x, where 1 + erf cancels."""
    xf = up(x)
    return (0.5 * xf * torch.special.erfc(-xf / math.sqrt(2.0))).to(x.dtype)


@candidate("gelu_tanh", name="torch")
def gelu_tanh_torch(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@candidate("gelu_tanh", name="sigmoid")
def gelu_tanh_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """0.5 (1 + tanh(u)) = sigmoid(2u)."""
    xf = up(x)
    u = math.sqrt(2.0 / math.pi) * (xf + 0.044715 * xf * xf * xf)
    return (xf * torch.sigmoid(2 * u)).to(x.dtype)


@candidate("softplus", name="torch")
def softplus_torch(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x)


@candidate("softplus", name="logaddexp")
def softplus_logaddexp(x: torch.Tensor) -> torch.Tensor:
    """log(exp(0) + exp(x)) in float32: the same function by another formula."""
    return torch.logaddexp(up(x).float(), torch.zeros((), device=x.device)).to(x.dtype)


@candidate("swiglu", name="torch")
def swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu in the input dtype, then the product: what an unfused model does."""
    return F.silu(gate) * up


@candidate("geglu", name="torch")
def geglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


SOFTMAX_CASES = tier_cases(
    Case("one-1x1", {"rows": 1, "cols": 1}),
    Case("rows-8x4096", {"rows": 8, "cols": 4096}),
    Case("large-16x1000", {"rows": 16, "cols": 1000}, regime="large"),
    Case("masked-8x300", {"rows": 8, "cols": 300, "mask": "causal"}),
    Case("fully-masked-6x64", {"rows": 6, "cols": 64, "mask": "some-rows"}),
    # a row longer than one online block (128) with a partial last block
    Case("unaligned-3x1031", {"rows": 3, "cols": 1031}),
    Case("unaligned-5x32001", {"rows": 5, "cols": 32001}, tier="pr"),
    Case("vocab-large-2x151936", {"rows": 2, "cols": 151936}, regime="large", tier="pr"),
    Case("noncontig-7x129", {"rows": 7, "cols": 129, "noncontiguous": True}, tier="pr"),
    Case("long-4x131072", {"rows": 4, "cols": 131072}, tier="nightly"),
)


def softmax_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    rows, cols = case["rows"], case["cols"]
    mask = torch.zeros(rows, cols, dtype=torch.bool)  # True = masked out
    if case.get("mask") == "causal":
        mask = torch.ones(rows, cols, dtype=torch.bool).triu(cols - rows + 1)
    elif case.get("mask") == "some-rows":
        mask[::2] = True  # every other row fully masked
        mask[1::2, : cols // 3] = True
    return {"x": values((rows, cols), case.regime, gen), "mask": mask}


def softmax_reference(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim with masked positions at -inf; a fully masked row is zeros."""
    xf = up(x).masked_fill(mask, -math.inf)
    peak = xf.amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    e = torch.exp(xf - peak)
    total = e.sum(-1, keepdim=True)
    return divide_or_zero(e, total).to(x.dtype)


register_operator(
    Operator(
        name="softmax",
        aten=("_softmax", "softmax", "_safe_softmax"),
        op_class="softmax",
        reference=softmax_reference,
        make_inputs=softmax_inputs,
        cases=SOFTMAX_CASES,
        reduction_length=lambda case: case["cols"],
        description="masked softmax; fully masked rows are zeros",
    )
)


@candidate("softmax", name="torch")
def softmax_torch(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = torch.softmax(up(x).masked_fill(mask, -math.inf), dim=-1)
    return out.nan_to_num(0.0).to(x.dtype)  # fully masked rows: 0/0 -> 0


#: Column block of the online softmax candidate.
ONLINE_BLOCK = 128


@candidate("softmax", name="online")
def softmax_online(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Column blocks of 128, each exponentiated against its own max and summed in float32,
    the blocks merged by rescaling to the row max (the online softmax's merge, every block
    at once)."""
    weights, total, _ = split_softmax(up(x).masked_fill(mask, -math.inf), ONLINE_BLOCK)
    return divide_or_zero(weights, total).to(x.dtype)
