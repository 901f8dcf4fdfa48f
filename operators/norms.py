"""Normalization: RMSNorm (with Gemma's 1 + weight), LayerNorm (with or without a bias),
fused residual add + RMSNorm."""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
import torch.nn.functional as F

from numalign.compare.tolerances import SWAP_PROBE_EPS
from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, Output, candidate, register_operator
from operators._common import tier_cases, up

NORM_CASES = tier_cases(
    Case("one-1x1", {"tokens": 1, "hidden": 1}),
    Case("tiny-3x8", {"tokens": 3, "hidden": 8}),
    Case("llm-8x4096", {"tokens": 8, "hidden": 4096}),
    Case("small-16x4096", {"tokens": 16, "hidden": 4096}, regime="small"),
    Case("outliers-16x4096", {"tokens": 16, "hidden": 4096}, regime="outliers"),
    Case("unaligned-33x4097", {"tokens": 33, "hidden": 4097}, tier="pr"),
    Case("prime-7x1031", {"tokens": 7, "hidden": 1031}),
    Case("large-4x5120", {"tokens": 4, "hidden": 5120}, regime="large", tier="pr"),
    Case("noncontig-9x768", {"tokens": 9, "hidden": 768, "noncontiguous": True}, tier="pr"),
    Case("empty-0x4096", {"tokens": 0, "hidden": 4096}, tier="pr"),
    # rows whose mean (30) is far above their spread (1): one-pass variance cancels
    Case("offset-8x4096", {"tokens": 8, "hidden": 4096, "mean": 30.0}, tier="pr"),
    Case("many-4096x8192", {"tokens": 4096, "hidden": 8192}, tier="nightly"),
)
#: RMSNorm grids add Gemma's and Qwen3-Next's (1 + weight) with a zero-centered weight: a
#: kernel that ignores the offset multiplies by a weight near 0 and fails at once.
RMS_CASES = tier_cases(
    *NORM_CASES,
    Case("gemma-offset-8x4096", {"tokens": 8, "hidden": 4096, "offset": 1.0}),
    Case(
        "gemma-offset-unaligned-5x2049",
        {"tokens": 5, "hidden": 2049, "offset": 1.0},
        regime="outliers",
        tier="pr",
    ),
)
#: Epsilon of Llama-family checkpoints; it dominates inputs with mean square near 1e-4 or less.
EPS = 1e-5


def rms_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """x [tokens, hidden]; weight [hidden] near 1, or near 0 where the case has an offset
    (zero-centered, as Gemma and Qwen3-Next store it); eps; offset (0 or 1)."""
    h = case["hidden"]
    offset = float(case.get("offset", 0.0))
    return {
        "x": values((case["tokens"], h), case.regime, gen) + case.get("mean", 0.0),
        "weight": 1.0 - offset + 0.1 * values((h,), "ordinary", gen),
        "eps": EPS,
        "offset": offset,
    }


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * (offset + weight); Gemma uses offset 1."""
    xf = up(x)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (offset + up(weight))).to(x.dtype)


#: The attribute a swapped RMSNorm module keeps the weight offset it was found to use in
#: (``_offset``): on the module itself, a constant Dynamo guards by value, where a weak
#: dictionary keyed by modules is guarded through their parameters, which a streamed model
#: frees after every call (a recompilation at each).
OFFSET_ATTRIBUTE = "_numalign_rms_norm_offset"


def _offset(module: Any, eps: float) -> float:
    """1 where the module multiplies by (1 + weight), else 0: by which form reproduces it on
    a probe input, not by its family's name (Qwen3.5's RMSNorm is zero-centered and named
    like the Gemma and Qwen3-Next families that are; Gemma 4's, named Gemma, is not). Found
    once per module."""
    found = module.__dict__.get(OFFSET_ATTRIBUTE)
    if found is None:
        weight = module.weight
        probe = torch.randn(3, weight.shape[-1], generator=torch.Generator().manual_seed(0))
        probe = probe.to(weight.device, weight.dtype)
        with torch.no_grad():
            # the class's own forward: the probe is no call of the model (no hooks fire),
            # and a swapped module's forward is the candidate (``replay.swap.Swapped``)
            theirs = up(type(module).forward(module, probe))
            errors = {
                offset: float(
                    (up(rms_norm_reference(probe, weight, eps, offset)) - theirs).abs().max()
                )
                for offset in (0.0, 1.0)
            }
        found = module.__dict__[OFFSET_ATTRIBUTE] = min(errors, key=errors.__getitem__)
    return float(found)


def _scale(module: Any) -> torch.nn.Parameter:
    """A norm's scale: its ``weight`` parameter. A norm without one (Gemma 4's ``v_norm``;
    Falcon-Mamba's weightless norm, whose ``weight`` is a dummy buffer of another size) is
    an AttributeError: the swap leaves it its own forward."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter):
        raise AttributeError(f"{type(module).__name__} has no scale parameter")
    return weight


def _rms_adapter(module: Any) -> dict[str, Any]:
    weight = _scale(module)
    group = getattr(module, "group_size", None)
    if group is not None and group != weight.shape[-1]:
        # Qwen4-Exp's hyper-connection norm: statistics per group of channels, another
        # operator than a norm over the whole width; the swap leaves it its own forward
        raise AttributeError(
            f"{type(module).__name__} normalises per group of {group} of its "
            f"{weight.shape[-1]} channels: a form the rms_norm adapter lacks"
        )
    eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", EPS)))
    # Gemma's, Qwen3-Next's and Qwen3.5's RMSNorm multiply by (1 + weight); Llama's by
    # weight. A swap checks the adapter against the module on a probe input, so a family
    # that does otherwise still is an error, not a silent mismatch.
    return {"weight": weight, "eps": eps, "offset": _offset(module, eps)}


register_operator(
    Operator(
        name="rms_norm",
        aten=("rsqrt",),
        probe_swap=True,
        op_class="normalization",
        reference=rms_norm_reference,
        make_inputs=rms_inputs,
        cases=RMS_CASES,
        reduction_length=lambda case: case["hidden"],
        hf_modules=("*RMSNorm",),
        adapter=_rms_adapter,
        description="RMSNorm with float32 statistics",
    )
)


@candidate("rms_norm", name="torch")
def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """torch's F.rms_norm on the upcast input."""
    xf = up(x)
    return F.rms_norm(xf, (x.shape[-1],), offset + up(weight), eps).to(x.dtype)


@candidate("rms_norm", name="fused")
def rms_norm_fused(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """One fused expression: the weight folded into the scale before the multiply."""
    xf = up(x)
    inv = torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + eps)
    return torch.addcmul(torch.zeros_like(xf), xf, inv * (offset + up(weight))).to(x.dtype)


def layer_norm_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    h = case["hidden"]
    return {
        # a mean offset, which a one-pass variance formula handles badly
        "x": values((case["tokens"], h), case.regime, gen) + case.get("mean", 0.5),
        "weight": 1.0 + 0.1 * values((h,), "ordinary", gen),
        "bias": 0.1 * values((h,), "ordinary", gen),
        "eps": EPS,
    }


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight (+ bias: Cohere's LayerNorm has none)."""
    xf = up(x)
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    out = (xf - mean) * torch.rsqrt(var + eps) * up(weight)
    return (out if bias is None else out + up(bias)).to(x.dtype)


#: A module's forward that subtracts a mean: the test of a LayerNorm form on meta weights
#: (the inventory's), where no probe can run.
_SUBTRACTS_MEAN = re.compile(r"-\s*mean\b")


def _is_layer_norm(module: Any) -> bool:
    """Whether ``module`` is a LayerNorm, by what it computes rather than its name: torch's
    ``nn.LayerNorm`` (and its subclasses), or a module named ``*LayerNorm`` with a 1-D weight
    that reproduces ``layer_norm_reference`` on a probe input (Cohere's, without a bias; not
    T5's, an RMSNorm; not Hubert's ``...StableLayerNorm`` encoder layers). On meta weights
    (the inventory's) the forward's source is read instead: it must subtract a mean."""
    if isinstance(module, torch.nn.LayerNorm):
        return True
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return False
    if weight.is_meta:
        return bool(_SUBTRACTS_MEAN.search(inspect.getsource(type(module).forward)))
    probe = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0))
    probe = probe.to(weight.device, weight.dtype)
    try:
        with torch.no_grad():
            theirs = up(type(module).forward(module, probe))  # as in ``_offset``
            mine = up(layer_norm_reference(probe, weight, getattr(module, "bias", None),
                                           _layer_norm_eps(module)))  # fmt: skip
    except Exception:  # a module of another signature is no LayerNorm form
        return False
    # as the swap's adapter check allows: a few roundings of the module's dtype
    tol = SWAP_PROBE_EPS * torch.finfo(weight.dtype).eps
    return bool(torch.allclose(mine, theirs, rtol=tol, atol=tol))


def _layer_norm_eps(module: Any) -> float:
    return float(getattr(module, "eps", getattr(module, "variance_epsilon", EPS)))


def _layer_norm_adapter(module: Any) -> dict[str, Any]:
    return {"weight": _scale(module), "bias": getattr(module, "bias", None),
            "eps": _layer_norm_eps(module)}  # fmt: skip


register_operator(
    Operator(
        name="layer_norm",
        aten=("native_layer_norm",),
        probe_swap=True,
        op_class="normalization",
        reference=layer_norm_reference,
        make_inputs=layer_norm_inputs,
        cases=NORM_CASES,
        reduction_length=lambda case: case["hidden"],
        hf_modules=("LayerNorm", "*LayerNorm"),
        hf_module_check=_is_layer_norm,
        adapter=_layer_norm_adapter,
        description="LayerNorm with float32 statistics (two-pass variance), bias optional",
    )
)


@candidate("layer_norm", name="torch")
def layer_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    return F.layer_norm(
        up(x), (x.shape[-1],), up(weight), None if bias is None else up(bias), eps
    ).to(x.dtype)


@candidate("layer_norm", name="var_mean")
def layer_norm_var_mean(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """torch.var_mean statistics (Welford on the CPU), then one fused multiply-add."""
    xf = up(x)
    if xf.numel() == 0:  # var_mean warns on empty reductions
        return x.clone()
    var, mean = torch.var_mean(xf, dim=-1, keepdim=True, correction=0)
    shift = torch.zeros_like(xf) if bias is None else up(bias)
    return torch.addcmul(shift, xf - mean, torch.rsqrt(var + eps) * up(weight)).to(x.dtype)


def add_rms_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    inputs = rms_inputs(case, gen)
    inputs["residual"] = values((case["tokens"], case["hidden"]), "outliers", gen)
    return inputs


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """r = x + residual, rounded to the dtype as it is stored; returns (RMSNorm(r), r)."""
    summed = (up(x) + up(residual)).to(x.dtype)
    return rms_norm_reference(summed, weight, eps, offset), summed


register_operator(
    Operator(
        name="add_rms_norm",
        op_class="normalization",
        reference=add_rms_norm_reference,
        make_inputs=add_rms_inputs,
        cases=RMS_CASES,
        outputs=(Output("out"), Output("residual")),
        reduction_length=lambda case: case["hidden"],
        description="fused residual add + RMSNorm: returns the normed output and the new residual",
    )
)


@candidate("add_rms_norm", name="fused")
def add_rms_norm_fused(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass: the sum rounded once for the stored residual, its statistics from that."""
    stored = (up(x) + up(residual)).to(x.dtype)
    # Statistics from the stored (rounded) residual, as the unfused pair would compute them.
    inv = torch.rsqrt(up(stored).square().mean(-1, keepdim=True) + eps)
    return (up(stored) * inv * (offset + up(weight))).to(x.dtype), stored
