"""Calibration: the reference model's own error in a lower dtype, per capture point, stored in
the manifest as the control for model verdicts (docs/comparison.md). It replays the model, so
it lives in ``replay``; ``capture_calibrated`` composes a capture (which only records) with it.

- accumulated: the whole model in the dtype, each point's outputs against the golden ones;
- isolated: each point's module alone in the dtype, fed the golden inputs;
- the model's own outputs (logits, or an encoder's hidden states) under ``OUTPUT_POINT``,
  accumulated, with the logits' agreement statistics (KL, top-1 and top-5);
- decode: the cached decode (``replay.decode.run_decode`` with the reference's dynamic cache)
  in the dtype, every step's new-token outputs, logits (with their agreement statistics) and
  the cache's states (under ``CACHE_POINT``) against the golden ones, the worst over steps.

Per point, output and mode the worst over requests and calls is kept: the errors (max abs,
relative L2, ...), the cosine (lowest), the norm ratio (farthest from 1) and the fraction of
exact zeros (highest), which the distribution rule judges a candidate against; and the range
of the isolated errors' leans (``compare.lean``: scale and offset, per channel the most
significant), pooled over every request and call, which the lean rule judges a candidate's
against (``compare.pooled``); at outputs kept as statistics only, the accumulated errors'
global leans too, the range where no test alone measured one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.compare import compute_metrics
from numalign.compare.calibration import (
    ERROR_STATISTICS,
    LOGITS_STATISTICS,
    merge_statistics,
)
from numalign.compare.lean import LeanSums
from numalign.compare.logits import logits_stats
from numalign.compare.output_kind import CALIBRATED_KINDS, ROUTING_KIND, TENSOR
from numalign.compare.routing import agreeing
from numalign.compare.statistics import statistics_metrics
from numalign.core import dtypes
from numalign.core.errors import Unsupported
from numalign.core.statistics import TensorStatistics
from numalign.golden.decode import REFERENCE_CACHE, limit_message
from numalign.golden.loading import load_reference
from numalign.golden.manifest import OUTPUT_POINT, CalibrationJson
from numalign.golden.positions import kept_positions
from numalign.golden.reference import Placement, forward_kwargs, model_outputs
from numalign.golden.statistics_info import StatisticsOnly
from numalign.golden.store import GoldenSet
from numalign.replay.decode import run_decode
from numalign.replay.layer import (
    AloneUnsupported,
    golden_outputs,
    replay_call,
    request_mask,
)

if TYPE_CHECKING:
    import torch

#: Statistics per (point, output path), the worst so far.
_Worst = dict[tuple[str, str], dict[str, float]]
#: Pooled leans per (point, output path, mode).
_Leans = dict[tuple[str, str, str], LeanSums]


def _stats(
    actual: torch.Tensor, expected: torch.Tensor | TensorStatistics, kind: str = TENSOR
) -> dict[str, float]:
    """The errors of one output (``ERROR_STATISTICS``, the distribution's); a router's routing
    (``kind``: ``compare.routing``) on the tokens whose chosen experts agree, with the
    fraction of tokens that choose differently (``flips``)."""
    if isinstance(expected, TensorStatistics):  # measured as a replay judges it
        return _statistics_stats(actual, expected)
    if kind == ROUTING_KIND and actual.shape == expected.shape:
        actual, expected, flips, tokens = agreeing(actual, expected)
        return _stats(actual, expected) | {"flips": flips / max(tokens, 1)}
    m = compute_metrics(actual, expected)
    out = {name: float(getattr(m, name)) for name in ERROR_STATISTICS}
    out["cosine"] = float(m.cosine)
    out["norm_ratio"] = float(m.norm_ratio)
    out["zero_fraction"] = float(m.zero_fraction_actual)
    out["nonfinite"] = float(m.nan_actual + m.inf_actual - m.nan_expected - m.inf_expected)
    return out


def _statistics_stats(actual: torch.Tensor, expected: TensorStatistics) -> dict[str, float]:
    """The errors of an output the set keeps as statistics only, as the judge measures a
    candidate's there (``compare.statistics``): the relative L2 error from the sketches, the
    cosine, the exact norm ratio and non-finite count; the rest unmeasured (NaN)."""
    m = statistics_metrics(actual, expected)
    out = dict.fromkeys(ERROR_STATISTICS, math.nan)
    out["rel_l2"] = float(m.rel_l2)
    out["max_expected"] = expected.absmax
    out["cosine"] = float(m.cosine)
    out["norm_ratio"] = float(m.norm_ratio)
    out["zero_fraction"] = float(int((actual == 0).sum()) / max(actual.numel(), 1))
    out["nonfinite"] = float(m.nan_actual + m.inf_actual - expected.nonfinite)
    return out


def _worst(into: dict[str, float] | None, new: dict[str, float]) -> dict[str, float]:
    """The worst of two samples, statistic by statistic (``merge_statistics``)."""
    if into is None:
        return new
    return {k: math.nan if v is None else v for k, v in merge_statistics([into, new]).items()}


def _json_safe(stats: dict[str, float]) -> dict[str, float | None]:
    return {k: (v if math.isfinite(v) else None) for k, v in stats.items()}


class DtypeUnsupported(Unsupported, RuntimeError):
    """The reference's own code cannot run in a dtype (XLNet's positional tables stay float32
    against bfloat16 weights; DeepSeek-V4 keeps float32 projections that float16 hidden
    states meet): the set records it (``Manifest.dtype_limits``), with no calibration of the
    dtype, and replay in it is skipped with the reason."""

    def __init__(self, dtype: str, reason: str) -> None:
        super().__init__(f"the reference cannot run in {dtype}: {reason}")
        self.dtype, self.reason = dtype, reason


def own_failure(golden: GoldenSet, model: Any, device: str, torch_dtype: torch.dtype) -> str | None:
    """The error the model's own forward raises on the set's requests as they are (no hooks,
    no module alone, no cache), in the dtype it was loaded in; None where it runs them all.
    Asked only once a calibration has failed, to tell the model's limit from numalign's."""
    import torch

    for request in golden.requests:
        inputs = {k: golden.tensor(v, device=device, dtype=torch_dtype)
                  for k, v in request.inputs.items()}  # fmt: skip
        try:
            with torch.no_grad():
                model(**inputs, **forward_kwargs(model))
        except Exception as exc:  # the reference's own limit, kept with its message
            return limit_message(exc)
    return None


def calibrate(
    golden: GoldenSet,
    model_dir: Path,
    dtype: str,
    *,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    device: str = "cpu",
    placement: Placement | None = None,
    stream: bool = False,
) -> CalibrationJson:
    """One member's calibration of ``dtype`` (this process's kernels and threads, with
    ``attn_implementation``), as JSON holds it:
    {point: {output path: {"isolated": stats, "accumulated": stats, "decode": stats}}} for
    ``dtype``; {OUTPUT_POINT: {output name: {"accumulated": stats, "decode": stats}}} for the
    model's own outputs; {CACHE_POINT: {state: {"decode": stats}}} for the KV cache.
    DtypeUnsupported where the calibration fails and the model's own forward fails in
    ``dtype`` too (``own_failure``). ``stream``: the model streamed unit by unit from the
    checkpoint (``golden.stream``), as a streamed capture's reference is."""

    torch_dtype = dtypes.torch_dtype(dtype)
    model = load_reference(model_dir, dtype, attn_implementation=attn_implementation,
                           trust_remote_code=trust_remote_code, placement=placement,
                           stream=stream, device=device)  # fmt: skip
    masks = {r.name: request_mask(golden, r.name) for r in golden.requests}
    leans: _Leans = {}
    try:
        accumulated = _accumulated(golden, model, masks, device, torch_dtype, leans)
        isolated = _isolated(golden, model, masks, device, torch_dtype, leans)
        decoded = _decoded(golden, model, device, torch_dtype)
    except Exception as exc:
        own = own_failure(golden, model, device, torch_dtype)
        if own is None:  # the reference runs in the dtype: numalign's error, raised as it is
            raise
        raise DtypeUnsupported(dtype, own) from exc
    modes = (("isolated", isolated), ("accumulated", accumulated), ("decode", decoded))
    result: CalibrationJson = {}
    for mode, table in modes:
        for (point_name, path), stats in table.items():
            pooled = leans.get((point_name, path, mode))
            measured = pooled.finish() if pooled is not None else None
            if measured is not None:
                stats = stats | measured.stats()
            result.setdefault(point_name, {}).setdefault(path, {})[mode] = _json_safe(stats)
    return result


def _accumulated(
    golden: GoldenSet,
    model: Any,
    masks: dict[str, Any],
    device: str,
    torch_dtype: torch.dtype,
    leans: _Leans,
) -> _Worst:
    """The whole model in the dtype: each point's outputs against the golden ones, and the
    model's own outputs (logits with the control's agreement) under ``OUTPUT_POINT``. At the
    outputs kept as statistics only, their leans pooled into ``leans`` (mode
    ``accumulated``): the honest range their pooled lean is judged against in the whole
    model, where most have no test alone (``compare.pooled``)."""
    import torch

    accumulated: _Worst = {}
    for request in golden.requests:
        name = request.name
        inputs = {
            k: golden.tensor(v, device=device, dtype=torch_dtype) for k, v in request.inputs.items()
        }

        def on_output(point: str, path: str, actual: Any, expected: Any, call: int) -> None:
            kind = golden.output_kind(point, path)
            if kind not in CALIBRATED_KINDS:
                return  # judged exactly (a mask, indices): no budget
            # every call of a point shares its calibration (the worst of them)
            stats = _stats(actual, expected, kind)
            accumulated[(point, path)] = _worst(accumulated.get((point, path)), stats)
            if isinstance(expected, TensorStatistics) and kind == TENSOR:
                leans.setdefault((point, path, "accumulated"), LeanSums()).add(actual, expected)

        with torch.no_grad(), golden_outputs(model, golden, name, on_output):
            finals = model_outputs(model(**inputs, **forward_kwargs(model)))
        for output, key in golden.final_outputs(name).items():
            actual = finals[output]
            expected = golden.tensor(key)
            mask = masks.get(name)
            kept_a, kept_e = kept_positions(actual, mask), kept_positions(expected, mask)
            stats = _stats(kept_a, kept_e)
            if output == "logits":
                # the control's own agreement, near ties not allowed: what rounding does
                agreement = logits_stats(kept_a.flatten(0, -2), kept_e.flatten(0, -2), 0.0)
                stats |= {k: float(getattr(agreement, k)) for k in LOGITS_STATISTICS}
            slot = (OUTPUT_POINT, output)
            accumulated[slot] = _worst(accumulated.get(slot), stats)
    return accumulated


def _isolated(
    golden: GoldenSet,
    model: Any,
    masks: dict[str, Any],
    device: str,
    torch_dtype: torch.dtype,
    leans: _Leans,
) -> _Worst:
    """Each point's module alone in the dtype, fed the golden inputs; its outputs' leans
    pooled into ``leans`` (``compare.pooled``: judged alone only)."""
    isolated: _Worst = {}
    for point in {p.name: p for p in golden.points}.values():
        module = model.get_submodule(point.name)
        for request_name, calls in point.calls.items():
            mask = masks.get(request_name)
            for call in calls:
                try:
                    outputs = replay_call(module, golden, call, device=device, dtype=torch_dtype)
                except (AloneUnsupported, StatisticsOnly):
                    continue  # no isolated calibration: its layer replay skips with the reason
                for path, key in call.outputs.items():
                    kind = golden.output_kind(point.name, path)
                    if path in outputs and kind in CALIBRATED_KINDS:
                        golden_output = golden.expected(key)
                        expected = (golden_output if isinstance(golden_output, TensorStatistics)
                                    else kept_positions(golden_output, mask))  # fmt: skip
                        actual = kept_positions(outputs[path], mask)
                        stats = _stats(actual, expected, kind)
                        isolated[(point.name, path)] = _worst(
                            isolated.get((point.name, path)), stats
                        )
                        if kind == TENSOR and actual.is_floating_point():
                            slot = (point.name, path, "isolated")
                            leans.setdefault(slot, LeanSums()).add(actual, expected)
    return isolated


def _decoded(golden: GoldenSet, model: Any, device: str, torch_dtype: torch.dtype) -> _Worst:
    """The cached decode in the dtype (the reference's dynamic cache): every step's
    new-token outputs, logits (with their agreement) and cache states, the worst over steps."""
    decoded: _Worst = {}

    def on_pair(
        request: str, step: int, point: str, path: str, actual: Any, expected: Any, call: int = 0
    ) -> None:
        stats = _stats(actual, expected, golden.output_kind(point, path))
        if point == OUTPUT_POINT:
            agreement = logits_stats(actual, expected, 0.0)
            stats |= {k: float(getattr(agreement, k)) for k in LOGITS_STATISTICS}
        decoded[(point, path)] = _worst(decoded.get((point, path)), stats)

    for request_name in golden.decode_requests:
        run_decode(golden, model, request_name, REFERENCE_CACHE, torch_dtype, device, on_pair)
    return decoded
