"""Runs one operator case: truth (reference in float64), control (reference in the target
dtype) and candidate (in the target dtype, on the device), then compares every output."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from numalign.cases import Case, generator, noncontiguous
from numalign.compare import (
    CompareResult,
    Metrics,
    Tolerance,
    TolerancePolicy,
    compare,
    compute_metrics,
    dtype_name,
)
from numalign.compare.tolerances import FLOAT_FORMATS
from numalign.phases import add_phase, phase
from numalign.registry import Candidate, Operator, Output
from numalign.truths import active_truth_cache

if TYPE_CHECKING:
    import torch

    from numalign.runtime.compiled import CompileSpec


def _cast(
    inputs: Mapping[str, Any], dtype: torch.dtype, device: torch.device, strided: bool
) -> dict[str, Any]:
    """Floating tensors to ``dtype`` on ``device`` (non-contiguous when ``strided``); other
    tensors to ``device``; everything else as it is. Always fresh copies."""
    import torch

    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            moved = value.to(
                device=device, dtype=dtype if value.is_floating_point() else value.dtype, copy=True
            )
            out[key] = noncontiguous(moved) if strided and moved.is_floating_point() else moved
        else:
            out[key] = value
    return out


def _named(op: Operator, value: Any) -> dict[str, Any]:
    import torch

    values = (value,) if isinstance(value, torch.Tensor) else tuple(value)
    if len(values) != len(op.outputs):
        raise ValueError(
            f"{op.name}: expected {len(op.outputs)} output(s) "
            f"({', '.join(o.name for o in op.outputs)}), got {len(values)}"
        )
    return {o.name: v for o, v in zip(op.outputs, values, strict=True)}


def make_inputs(op: Operator, case: Case) -> dict[str, Any]:
    """The case's float64 inputs, seeded by operator and case (the same for every candidate
    and dtype)."""
    return op.make_inputs(case, generator(op.name, case.name, case.regime))


#: Truths kept per worker: tests of one case with other candidates reuse them.
_TRUTH_CACHE_SIZE = 4
_truths: OrderedDict[tuple[str, str, str], tuple[dict[str, Any], dict[str, Any]]] = OrderedDict()


def inputs_and_truth(
    op: Operator, case: Case, dtype: torch.dtype
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The case's inputs rounded to ``dtype`` (on the CPU) and the reference's float64
    outputs on exactly those values, cached per worker.

    The truth sees the rounded inputs, upcast: rounding the inputs is not the kernel's error,
    and selections (top-k, routing) must be judged on the values the kernel saw."""
    import torch

    key = (op.name, case.name, str(dtype))
    if key in _truths:
        _truths.move_to_end(key)
        return _truths[key]
    disk = active_truth_cache()
    with phase("cache"):
        stored = disk.load(op, case, dtype) if disk is not None else None
    if stored is not None:
        entry = stored
    else:
        with phase("inputs"):
            rounded = _cast(make_inputs(op, case), dtype, torch.device("cpu"), strided=False)
        with phase("truth"):
            upcast = _cast(rounded, torch.float64, torch.device("cpu"), strided=False)
            entry = (rounded, _named(op, op.reference(**upcast)))
        if disk is not None:
            with phase("cache"):
                disk.store(op, case, dtype, *entry)
    _truths[key] = entry
    while len(_truths) > _TRUTH_CACHE_SIZE:
        _truths.popitem(last=False)
    return entry


#: Controls kept per worker, by operator (and its reference), case, dtype and device.
_controls: OrderedDict[tuple[str, int, str, str, str], dict[str, Any]] = OrderedDict()


def _control(
    op: Operator, case: Case, dtype: torch.dtype, device: torch.device, inputs: dict[str, Any]
) -> dict[str, Any]:
    """The reference run in ``dtype`` on ``device`` (the honest control), cached per worker
    like the truths: every candidate of a case is judged against the same one."""
    key = (op.name, id(op.reference), case.name, str(dtype), str(device))
    if key in _controls:
        _controls.move_to_end(key)
        return _controls[key]
    control = _named(op, op.reference(**_cast(inputs, dtype, device, strided=False)))
    _controls[key] = control
    while len(_controls) > _TRUTH_CACHE_SIZE:
        _controls.popitem(last=False)
    return control


def check_operator(
    op: Operator,
    candidate: Candidate,
    case: Case,
    dtype: torch.dtype,
    device: torch.device,
    *,
    policy: TolerancePolicy | None = None,
    compiled: CompileSpec | None = None,
) -> list[CompareResult]:
    """Compares ``candidate`` with the operator's reference on one case; one result per
    output. Float outputs are judged against the control's error budget; exact outputs
    against the control; tie-aware outputs against the truth, with ties judged on the scores
    in ``dtype``; quantized outputs by their rounding (``judge_rounding``). Truth, control and
    candidate all see the same inputs rounded to ``dtype``.

    With ``compiled``, the candidate runs through ``torch.compile`` (compiled once per worker
    and spec: ``candidate_function``); the reference and the control stay eager, so the
    compiled kernel is held to the same budget as the eager one. Compile time goes to phase
    ``compile``, not ``candidate``."""
    inputs, truth = inputs_and_truth(op, case, dtype)
    strided = bool(case.get("noncontiguous", False))
    with phase("control"):
        control = _control(op, case, dtype, device, inputs)
    fn = candidate_function(op, candidate, compiled)
    stats = getattr(fn, "stats", None)
    compiled_before = stats.compile_s if stats is not None else 0.0
    start = time.perf_counter()
    actual = _named(op, fn(**_cast(inputs, dtype, device, strided=strided)))
    spent = stats.compile_s - compiled_before if stats is not None else 0.0
    add_phase("compile", spent)
    add_phase("candidate", time.perf_counter() - start - spent)
    compare_start = time.perf_counter()
    reduction = op.reduction_length(case) if op.reduction_length else None
    results = []
    for output in op.outputs:
        name = op.name if len(op.outputs) == 1 else f"{op.name}.{output.name}"
        a = actual[output.name]
        if output.kind == "float":
            expected, reference = truth[output.name], control[output.name].to(a.device)
            undecided = output.undecided(inputs, case) if output.undecided else None
            if undecided is not None:
                a, expected, reference = (
                    _zero_where(undecided, t) for t in (a, expected, reference)
                )
            result = compare(
                a,
                expected,
                control=reference,
                op_class=op.op_class,
                reduction_length=reduction,
                name=name,
                policy=policy,
                budget=op.budget,
            )
            if undecided is not None and bool(undecided.any()):
                count = int(undecided.sum())
                result = dataclasses.replace(
                    result,
                    reason=f"{result.reason}; {count} position(s) that rounding alone decides "
                    "are not compared",
                )
        elif output.kind == "exact":
            tol = Tolerance(rtol=0.0, atol=output.atol) if output.atol else None
            result = compare(a, control[output.name], tolerance=tol, name=name)
        elif output.kind == "quantized":
            result = judge_rounding(
                a,
                actual[output.scale_from or ""],
                inputs[output.quantized_from or ""],
                output,
                name=name,
                case=case,
            )
        else:
            source = output.ties_from or ""
            scores = truth[source] if source in truth else inputs[source]
            result = compare(
                a, truth[output.name], ties=scores.to(dtype), name=name, op_class="selection"
            )
        results.append(result)
    add_phase("compare", time.perf_counter() - compare_start)
    return results


def _zero_where(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` with the positions of ``mask`` set to zero (``mask`` moved to ``t``'s device)."""
    return t.masked_fill(mask.to(t.device), 0)


def candidate_function(
    op: Operator, candidate: Candidate, compiled: CompileSpec | None
) -> Callable[..., Any]:
    """The candidate's function, or with ``compiled`` its compiled form (a
    ``CompiledFunction``, kept per worker: every case and dtype of the candidate reuses it;
    its ``stats`` hold the compile time and graph breaks not yet taken by a test)."""
    if compiled is None:
        return candidate.fn
    from numalign.runtime.compiled import compiled_function

    what = f"candidate {candidate.name!r} of {op.name} ({candidate.module})"
    return compiled_function(candidate.fn, compiled, what)


def expand_scale(
    scale: torch.Tensor,
    shape: torch.Size | tuple[int, ...],
    block: tuple[int | None, ...] | None = None,
) -> torch.Tensor:
    """``scale`` expanded to one scale per element of ``shape``.

    ``block`` (see ``numalign.registry.CodeLayout``) gives, per dimension, how many
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
        decoded = q.view(getattr(torch, fmt))
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
    dtype = getattr(torch, fmt)
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


def judge_rounding(
    q: torch.Tensor,
    scale: torch.Tensor,
    x: torch.Tensor,
    output: Output,
    *,
    name: str,
    case: Case | None = None,
) -> CompareResult:
    """Judges a quantizer's codes by their round trip against the float64 truth.

    ``x`` is the input as the quantizer saw it; ``scale`` is the candidate's own, so its
    rounding is judged whatever scale it chose (the scale output is judged on its own). The
    codes are read in the format that ``output.layout_for(case)`` declares (E4M3 bits in
    uint8 decoded to their values; codes in another format fail by rule "rounding") and the
    scale repeated over the declared blocks (a scale of another shape fails by rule
    "shape"). The rule (``output.rounding``) then bounds, in steps of the format's grid at
    x / scale: the worst element's distance from x / scale, the share of elements rounded
    to the farther neighbour, and the mean signed error beyond round to nearest's, overall
    and toward zero. The metrics are those of the round trip codes * scale against x;
    ``budget`` holds the measures and their limits."""
    import dataclasses
    import math

    import torch

    rule = output.rounding
    layout = output.layout_for(case)
    failed = CompareResult(
        name=name, dtype=layout.codes or dtype_name(q.dtype), shape=tuple(q.shape),
        op_class="quantization", passed=False, rule="shape", reason="", budget_used=math.inf,
        metrics=Metrics.blank(
            q.numel(), error=math.nan, agreement=math.nan, mismatch_count=q.numel()
        ),
    )  # fmt: skip
    if q.shape != x.shape:
        return dataclasses.replace(
            failed, reason=f"shape {tuple(q.shape)} differs from the input's {tuple(x.shape)}",
            hint="return one code per input element",
        )  # fmt: skip
    try:
        qd, fmt = _decode_codes(q.detach().cpu(), layout.codes)
    except ValueError as error:
        return dataclasses.replace(
            failed, rule="rounding", reason=str(error),
            hint=f"quantize to {layout.codes}: another format has another grid and range "
            "(E5M2 keeps 2 mantissa bits, E4M3 3)",
        )  # fmt: skip
    try:
        sd = expand_scale(scale.detach().cpu().to(torch.float64), q.shape, layout.block)
    except ValueError as error:
        return dataclasses.replace(
            failed, reason=str(error),
            hint="return one scale per block, the last block of each dimension possibly "
            "partial (a kernel that assumes whole blocks drops the tail's scale)",
        )  # fmt: skip
    xd = x.detach().cpu().to(torch.float64)
    base = dataclasses.replace(
        failed, passed=True, rule="rounding", budget_used=0.0,
        metrics=compute_metrics(qd * sd, xd),
    )  # fmt: skip
    if qd.numel() == 0:
        return dataclasses.replace(base, reason="no values to round")
    if not bool(torch.isfinite(sd).all() and (sd > 0).all() and torch.isfinite(qd).all()):
        return dataclasses.replace(
            base, passed=False, rule="non-finite", budget_used=math.inf,
            reason="a scale is zero, negative or not finite, or a value is not finite",
            hint="an all-zero block needs a positive scale (any value; the reference uses 1); "
            "saturate float8 values at the format's largest finite value",
        )  # fmt: skip
    m = _rounding_measures(qd, fmt, xd / sd, rule.tie_band)
    worst_at = int(m.pop("worst_flat_index"))
    limits = {
        "max_step_error_limit": rule.max_step_error + rule.tie_band,
        "off_by_one_share_limit": rule.off_by_one_share,
        "bias_limit_steps": rule.bias_limit,
    }
    bias = max(abs(m["bias_steps"]), abs(m["toward_zero_steps"]))
    used = max(
        m["max_step_error"] / limits["max_step_error_limit"],
        m["off_by_one_share"] / rule.off_by_one_share if rule.off_by_one_share else 0.0,
        bias / rule.bias_limit if rule.bias_limit else 0.0,
    )
    result = dataclasses.replace(
        base, budget=m | limits, budget_used=used,
        metrics=dataclasses.replace(base.metrics, mismatch_count=int(m["off_by_one"])),
    )  # fmt: skip
    if m["max_step_error"] > limits["max_step_error_limit"]:
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst_at), q.shape))
        return dataclasses.replace(
            result, passed=False,
            reason=f"an element is {m['max_step_error']:.3g} steps from x / scale at {at} (at "
            f"most {limits['max_step_error_limit']:.3g}: one step off at worst)",
            hint="check the scale used to quantize (the one returned), clamping and overflow"
            + (f", and that the codes are {layout.codes}" if layout.codes else ""),
        )  # fmt: skip
    if m["off_by_one_share"] > rule.off_by_one_share:
        return dataclasses.replace(
            result, passed=False,
            reason=f"{int(m['off_by_one'])} of {q.numel()} elements "
            f"({100 * m['off_by_one_share']:.2f}%) round to the farther neighbour (at most "
            f"{100 * rule.off_by_one_share:.2g}%)",
            hint="round to nearest (ties to even), not truncation or floor; quantize with the "
            "scale you return (x / scale in float32, not through a 16-bit intermediate)",
        )  # fmt: skip
    if bias > rule.bias_limit:
        return dataclasses.replace(
            result, passed=False,
            reason=f"the rounding is biased: {m['bias_steps']:+.3g} steps on average from "
            f"round to nearest, {m['toward_zero_steps']:+.3g} steps toward zero (at most "
            f"{rule.bias_limit:.3g})",
            hint="a biased rounding (truncation, floor, ceil) shifts every dequantized value "
            "the same way: round to nearest",
        )  # fmt: skip
    return dataclasses.replace(
        result,
        reason=f"rounds to nearest (worst {m['max_step_error']:.3g} steps, "
        f"{int(m['off_by_one'])} off by one, bias {m['bias_steps']:+.2g} steps)",
    )
