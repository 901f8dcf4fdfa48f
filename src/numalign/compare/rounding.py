"""Rule "rounding": a quantizer's codes judged by their round trip against the float64
truth, given the rule (``RoundingRule``) and the codes' layout (``CodeLayout``: their format
and the blocks that share a scale)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from numalign.compare.budgets import Decision, RoundingBudget
from numalign.compare.metrics import Metrics, compute_metrics
from numalign.compare.policy import DEFAULT_POLICY, TolerancePolicy
from numalign.compare.result import CompareResult
from numalign.compare.tolerances import (
    FLOAT_FORMATS,
    ROUNDING_BIAS_LIMIT,
    ROUNDING_MAX_STEP_ERROR,
    ROUNDING_OFF_BY_ONE_SHARE,
    ROUNDING_TIE_BAND,
)
from numalign.core import dtypes
from numalign.core.dtypes import dtype_name

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RoundingRule:
    """How a quantizer's rounding is judged (outputs of kind "quantized").

    Quantized values q (the codes, decoded: see ``CodeLayout``) with scale s stand for
    x / s. Each element's rounding error is measured in steps of the codes' grid at x / s (1
    for integers, the format's spacing there for float8), against the float64 truth and the
    scale the candidate returned: r = (q - x / s) / step. Round to nearest gives |r| <= 0.5;
    truncation gives r in (-1, 0] toward zero, 40-50% of the elements off by one, all of
    them biased the same way. The defaults and their reasons are in
    ``compare.tolerances`` (``ROUNDING_*``); pyproject overrides may replace any field."""

    #: Elements within this many steps of a rounding tie may round either way.
    tie_band: float = ROUNDING_TIE_BAND
    #: No element may be more than this many steps from x / s (one step off at worst).
    max_step_error: float = ROUNDING_MAX_STEP_ERROR
    #: At most this share of elements may round to the farther neighbour.
    off_by_one_share: float = ROUNDING_OFF_BY_ONE_SHARE
    #: The mean signed error beyond round to nearest's own, in steps.
    bias_limit: float = ROUNDING_BIAS_LIMIT


#: The rounding rule of quantizers that round to nearest.
ROUND_TO_NEAREST = RoundingRule()

#: Integer code formats (their grid is the integers); float8 formats are those of
#: ``compare.tolerances.FLOAT_FORMATS``.
INTEGER_CODES: tuple[str, ...] = ("int8", "uint8", "int16", "int32")


@dataclass(frozen=True)
class CodeLayout:
    """What a quantizer's values (its codes) are, and which of them share a scale.

    ``codes`` names the format the codes are in: an integer dtype of ``INTEGER_CODES`` (the
    codes are those integers) or a float format such as "float8_e4m3fn": the codes are of
    that dtype or are its bit patterns as uint8 (``q.view(torch.uint8)``: the suite casts
    floating inputs to the dtype under test, never integer ones, so FP8 caches travel as
    bits). Codes of any other dtype fail: an E5M2 tensor where E4M3 is declared. None: the
    codes' own dtype, whatever it is (uint8 then reads as integers).

    ``block`` gives, per dimension of the codes, how many consecutive elements share one
    scale: the scale has ceil(n / block) entries along a dimension of n, the last block
    possibly partial (1x128 groups over 4097 columns: 33 scales, the last over 1 column).
    None in the tuple: one scale along the whole dimension (size 1 there). ``block=None``:
    the scale broadcasts against the codes. A scale of another shape fails."""

    codes: str | None = None
    block: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.codes is not None and self.codes not in (*INTEGER_CODES, *FLOAT_FORMATS):
            raise ValueError(
                f"code format {self.codes!r}: expected one of "
                f"{', '.join((*INTEGER_CODES, *FLOAT_FORMATS))}"
            )
        if self.block is not None and not all(b is None or b >= 1 for b in self.block):
            raise ValueError(f"block {self.block}: sizes are positive, or None for a whole dim")


#: The layout of codes in their own dtype whose scale broadcasts.
DEFAULT_LAYOUT = CodeLayout()


def judge_rounding(
    q: torch.Tensor,
    scale: torch.Tensor,
    x: torch.Tensor,
    rule: RoundingRule = ROUND_TO_NEAREST,
    layout: CodeLayout = DEFAULT_LAYOUT,
    *,
    name: str,
    policy: TolerancePolicy | None = None,
) -> CompareResult:
    """Judges a quantizer's codes by their round trip against the float64 truth.

    ``x`` is the input as the quantizer saw it; ``scale`` is the candidate's own, so its
    rounding is judged whatever scale it chose (the scale output is judged on its own). The
    codes are read in the format that ``layout`` declares (E4M3 bits in uint8 decoded to
    their values; codes in another format fail by rule "rounding") and the scale repeated
    over the declared blocks (a scale of another shape fails by rule "shape"). The ``rule``
    (with the fields a pyproject override of ``policy`` gives for ``name`` in x's dtype)
    then bounds, in steps of the format's grid at x / scale: the worst element's distance
    from x / scale, the share of elements rounded to the farther neighbour, and the mean
    signed error beyond round to nearest's, overall and toward zero. The metrics are those
    of the round trip codes * scale against x; ``budget`` holds the measures and their
    limits."""
    import torch

    policy = policy or DEFAULT_POLICY
    rule = policy.rounding(name, dtype_name(x.dtype), rule)
    failed = CompareResult(
        name=name, dtype=layout.codes or dtype_name(q.dtype), shape=tuple(q.shape),
        op_class="quantization", passed=False, rule="shape", reason="", budget_used=math.inf,
        metrics=Metrics.blank(
            q.numel(), error=math.nan, agreement=math.nan, mismatch_count=q.numel()
        ),
    )  # fmt: skip
    decoded = _decoded(q, scale, x, layout, failed)
    if isinstance(decoded, CompareResult):
        return decoded
    qd, fmt, sd = decoded
    xd = x.detach().cpu().to(torch.float64)
    base = replace(
        failed, passed=True, rule="rounding", budget_used=0.0,
        metrics=compute_metrics(qd * sd, xd),
    )  # fmt: skip
    if qd.numel() == 0:
        return replace(base, reason="no values to round")
    if not bool(torch.isfinite(sd).all() and (sd > 0).all() and torch.isfinite(qd).all()):
        return replace(
            base, passed=False, rule="non-finite", budget_used=math.inf,
            reason="a scale is zero, negative or not finite, or a value is not finite",
            hint="an all-zero block needs a positive scale (any value; the reference uses 1); "
            "saturate float8 values at the format's largest finite value",
        )  # fmt: skip
    source = policy.source("rounding", name, dtype_name(x.dtype)) or "rule"
    return _judge_steps(base, qd, fmt, xd / sd, rule, layout, source)


def _decoded(
    q: torch.Tensor,
    scale: torch.Tensor,
    x: torch.Tensor,
    layout: CodeLayout,
    failed: CompareResult,
) -> tuple[torch.Tensor, str | None, torch.Tensor] | CompareResult:
    """Rules "shape" and "rounding" (the codes' format) before any measure: the codes'
    values, their grid's format and the scale per element, or the failed result."""
    import torch

    if q.shape != x.shape:
        return replace(
            failed, reason=f"shape {tuple(q.shape)} differs from the input's {tuple(x.shape)}",
            hint="return one code per input element",
        )  # fmt: skip
    try:
        qd, fmt = _decode_codes(q.detach().cpu(), layout.codes)
    except ValueError as error:
        return replace(
            failed, rule="rounding", reason=str(error),
            hint=f"quantize to {layout.codes}: another format has another grid and range "
            "(E5M2 keeps 2 mantissa bits, E4M3 3)",
        )  # fmt: skip
    try:
        sd = expand_scale(scale.detach().cpu().to(torch.float64), q.shape, layout.block)
    except ValueError as error:
        return replace(
            failed, reason=str(error),
            hint="return one scale per block, the last block of each dimension possibly "
            "partial (a kernel that assumes whole blocks drops the tail's scale)",
        )  # fmt: skip
    return qd, fmt, sd


def _judge_steps(
    base: CompareResult,
    qd: torch.Tensor,
    fmt: str | None,
    v: torch.Tensor,
    rule: RoundingRule,
    layout: CodeLayout,
    source: str,
) -> CompareResult:
    """Rule "rounding" on the codes' values ``qd`` against v = x / scale: the measures
    against the rule's limits (``RoundingBudget``)."""
    m = _rounding_measures(qd, fmt, v, rule.tie_band)
    worst_at = int(m.pop("worst_flat_index"))
    budget = RoundingBudget(
        max_step_error_limit=rule.max_step_error + rule.tie_band,
        off_by_one_share_limit=rule.off_by_one_share, bias_limit_steps=rule.bias_limit,
        source=source,
    )  # fmt: skip
    bias = max(abs(m["bias_steps"]), abs(m["toward_zero_steps"]))
    used = max(
        m["max_step_error"] / budget.max_step_error_limit,
        m["off_by_one_share"] / rule.off_by_one_share if rule.off_by_one_share else 0.0,
        bias / rule.bias_limit if rule.bias_limit else 0.0,
    )
    result = replace(
        base, budget=m | budget.limits(), budget_used=used,
        metrics=replace(base.metrics, mismatch_count=int(m["off_by_one"])),
    )  # fmt: skip
    decision = _rounding_decision(m, bias, rule, budget, worst_at, tuple(qd.shape), layout)
    if not decision.passed:
        return replace(result, passed=False, reason=decision.reason, hint=decision.hint)
    return replace(result, reason=decision.reason)


def _rounding_decision(
    m: dict[str, float],
    bias: float,
    rule: RoundingRule,
    budget: RoundingBudget,
    worst_at: int,
    shape: tuple[int, ...],
    layout: CodeLayout,
) -> Decision:
    """The rounding rule's verdict on the measures ``m``: one step off at worst, few
    elements rounded to the farther neighbour, no bias."""
    import torch

    if m["max_step_error"] > budget.max_step_error_limit:
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst_at), shape))
        return Decision(
            "rounding", False,
            f"an element is {m['max_step_error']:.3g} steps from x / scale at {at} (at "
            f"most {budget.max_step_error_limit:.3g}: one step off at worst)",
            "check the scale used to quantize (the one returned), clamping and overflow"
            + (f", and that the codes are {layout.codes}" if layout.codes else ""),
            budget=budget,
        )  # fmt: skip
    numel = math.prod(shape)
    if m["off_by_one_share"] > rule.off_by_one_share:
        return Decision(
            "rounding", False,
            f"{int(m['off_by_one'])} of {numel} elements "
            f"({100 * m['off_by_one_share']:.2f}%) round to the farther neighbour (at most "
            f"{100 * rule.off_by_one_share:.2g}%)",
            "round to nearest (ties to even), not truncation or floor; quantize with the "
            "scale you return (x / scale in float32, not through a 16-bit intermediate)",
            budget=budget,
        )  # fmt: skip
    if bias > rule.bias_limit:
        return Decision(
            "rounding", False,
            f"the rounding is biased: {m['bias_steps']:+.3g} steps on average from "
            f"round to nearest, {m['toward_zero_steps']:+.3g} steps toward zero (at most "
            f"{rule.bias_limit:.3g})",
            "a biased rounding (truncation, floor, ceil) shifts every dequantized value "
            "the same way: round to nearest",
            budget=budget,
        )  # fmt: skip
    return Decision(
        "rounding", True,
        f"rounds to nearest (worst {m['max_step_error']:.3g} steps, "
        f"{int(m['off_by_one'])} off by one, bias {m['bias_steps']:+.2g} steps)",
        budget=budget,
    )  # fmt: skip


def expand_scale(
    scale: torch.Tensor,
    shape: torch.Size | tuple[int, ...],
    block: tuple[int | None, ...] | None = None,
) -> torch.Tensor:
    """``scale`` expanded to one scale per element of ``shape``.

    ``block`` (see ``CodeLayout``) gives, per dimension, how many
    consecutive elements share a scale, the last block possibly partial (None: the whole
    dimension, where the scale has size 1); ``block=None``: the scale broadcasts. Block sizes
    are declared, never guessed from the sizes: 33 scales over 4097 columns are groups of
    128, not of ceil(4097 / 33) = 125. Raises ValueError, with the shape expected, where the
    scale does not fit."""
    shape = tuple(shape)
    if block is None:
        own = tuple(scale.shape)
        fits = len(own) <= len(shape) and all(
            s in (1, n) for s, n in zip(own[::-1], shape[::-1], strict=False)
        )
        if not fits:
            raise ValueError(
                f"scale of shape {tuple(scale.shape)} does not broadcast against values of "
                f"shape {shape}"
            )
        return scale.expand(shape)
    if len(block) != len(shape):
        raise ValueError(f"blocks {_blocks(block)} do not fit values of shape {shape}")
    if scale.dim() == 0 and all(b is None for b in block):
        return scale.expand(shape)  # one scale for everything, as a 0-d tensor
    expected = tuple(1 if b is None else -(-n // b) for b, n in zip(block, shape, strict=True))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale of shape {tuple(scale.shape)} does not match blocks of {_blocks(block)} "
            f"over values of shape {shape}: expected {expected}"
        )
    for dim, b in enumerate(block):
        if b is not None and b > 1:
            scale = scale.repeat_interleave(b, dim).narrow(dim, 0, shape[dim])
    return scale.expand(shape)


def _blocks(block: tuple[int | None, ...]) -> str:
    """A block shape as text: 1x128, or *x1x*x* (* = the whole dimension)."""
    return "x".join("*" if b is None else str(b) for b in block)


def _decode_codes(q: torch.Tensor, codes: str | None) -> tuple[torch.Tensor, str | None]:
    """The codes' values as float64 and the float format whose grid they lie on (None: the
    integers). ``codes`` is the declared format (None: the codes' own dtype); float formats
    may come as their bit patterns in uint8. Raises ValueError for codes of another format."""
    import torch

    own = dtype_name(q.dtype)
    fmt = codes or own
    if fmt == own:
        decoded = q
    elif fmt in FLOAT_FORMATS and q.dtype == torch.uint8:
        decoded = q.view(dtypes.torch_dtype(fmt))
    else:
        bits = " (or its bit patterns as uint8)" if fmt in FLOAT_FORMATS else ""
        raise ValueError(f"the codes are {own}, not the declared {fmt}{bits}")
    return decoded.to(torch.float64), fmt if decoded.is_floating_point() else None


def _grid_step(fmt: str | None, v: torch.Tensor) -> torch.Tensor:
    """The spacing of the grid of ``fmt`` at ``v`` (float64): 1 for integers (None); for a
    float format, its ulp at |v| (its smallest subnormal at and below the normal range)."""
    import torch

    if fmt is None:
        return torch.ones_like(v)
    mantissa, min_exp = FLOAT_FORMATS[fmt]
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0**min_exp)))
    return torch.exp2((exponent - mantissa).clamp_min(min_exp))


def _nearest(fmt: str | None, v: torch.Tensor) -> torch.Tensor:
    """The point of the grid of ``fmt`` nearest to ``v`` (ties to even), as float64: the
    integers for None; float formats saturate at their largest finite value."""
    import torch

    if fmt is None:
        return torch.round(v)
    dtype = dtypes.torch_dtype(fmt)
    top = float(torch.finfo(dtype).max)
    return v.clamp(-top, top).to(dtype).to(torch.float64)


def _rounding_measures(
    qd: torch.Tensor, fmt: str | None, v: torch.Tensor, tie_band: float
) -> dict[str, float]:
    """In steps of the grid of ``fmt`` at v = x / scale, for the codes' values ``qd``: the
    worst |qd - v|, the share of elements rounded to the farther neighbour (outside
    ``tie_band``), and the mean of qd minus the nearest grid point, overall and toward zero
    (0 for an element within the tie band, which may round either way)."""
    import torch

    step = _grid_step(fmt, v)
    r = (qd - v) / step
    farther = r.abs() > 0.5 + tie_band
    moved = torch.where(farther, (qd - _nearest(fmt, v)) / step, 0.0)
    return {
        "max_step_error": float(r.abs().max()),
        "worst_flat_index": float(r.abs().argmax()),
        "off_by_one": float(farther.sum()),
        "off_by_one_share": float(farther.double().mean()),
        "bias_steps": float(moved.mean()),
        "toward_zero_steps": float(-(moved * torch.sign(v)).mean()),
    }
