"""A golden set's power per point: what a pass at each capture point would catch,
stored in the set's manifest (``Manifest.power``) so that a user reading a set knows, before
any replay, how small a systematic error its budgets can see there.

Every comparison computes its own power (``CompareResult.detectable``, ``compare.power``):
the smallest relative scale and additive bias (in units of the truth's RMS) that its rules
would have failed. Here each point output calibrated in a dtype and mode is compared as a
replay compares it, by the one judge (``compare.judge.Judge``),
against a stand-in candidate: the golden truth rounded to the dtype, the most honest
candidate there is (the figures hold the candidate's own noise out, and rounding is the
least of it). The set's figure is the largest over the point's requests and calls (the
least power: what a pass is sure to catch everywhere). Modes are those of the point
replays: ``isolated`` (each call, probes included, as layer replay judges it) and
``accumulated`` (each request's calls, as the whole-model replay judges them; no probes,
which no request makes). Boolean and integer outputs have no power (their rules are exact,
not about a size), and neither has an output the set holds no calibration of.

The pooled lean rule (``compare.pooled``) and decode and logits verdicts are not figured here:
they judge many outputs together or outputs that are not a capture point's call.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.compare.judge import Judge
from numalign.compare.model_verdict import Uncalibrated
from numalign.compare.output_kind import CALIBRATED_KINDS
from numalign.core import dtypes
from numalign.golden.manifest import PROBE_REQUEST, PowerJson
from numalign.golden.positions import kept_positions
from numalign.replay.layer import request_mask
from numalign.replay.model import hidden_and_depth

if TYPE_CHECKING:
    from numalign.compare.power import Detectable
    from numalign.golden.store import GoldenSet, Point

__all__ = ["MODES", "model_config", "power_line", "power_summary", "set_power"]

#: The modes a point's power is figured in: the point replayed alone on golden inputs, and
#: inside the whole model.
MODES = ("isolated", "accumulated")


def model_config(model_dir: str | Path, trust_remote_code: bool = False) -> Any:
    """The model folder's config (transformers' ``AutoConfig``, never downloading)."""
    import transformers

    return transformers.AutoConfig.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=trust_remote_code
    )


def set_power(golden: GoldenSet, *, config: Any = None, policy: Any = None) -> PowerJson:
    """dtype -> point -> output path -> mode -> {"scale", "bias"}: per point output
    calibrated in a dtype and mode, the largest figure over its requests and calls of what a
    pass there would catch (the module's docstring). ``config``: the model's config (its
    hidden size and depth size the controls, as in replay; default: read from the set's
    model folder); ``policy``: the tolerance policy replays judge with (default: numalign's)."""
    config = config if config is not None else model_config(golden.model_dir)
    hidden, depth = hidden_and_depth(config=config)
    power: PowerJson = {}
    for dtype in golden.manifest.calibration:
        points = {}
        for point in golden.points:
            figures = _point_power(golden, dtype, point, hidden, depth, policy)
            if figures:
                points[point.name] = figures
        if points:
            power[dtype] = points
    return power


def _point_power(
    golden: GoldenSet, dtype: str, point: Point, hidden: int, depth: int, policy: Any
) -> dict[str, dict[str, dict[str, float]]]:
    """output path -> mode -> the largest scale and bias over the point's requests and
    calls, for the outputs ``dtype`` calibrates (the expected tensor taken as
    ``replay_layer`` takes it: the positions the request's mask keeps)."""
    torch_dtype = dtypes.torch_dtype(dtype)
    judges = {m: Judge(golden, dtype, m, hidden, depth, policy, leans=False) for m in MODES}
    worst: dict[str, dict[str, dict[str, float]]] = {}
    for request, calls in point.calls.items():
        mask = request_mask(golden, request)
        for call in calls:
            for path, key in call.outputs.items():
                modes = [m for m in MODES
                         if golden.calibrated(dtype, point.name, path, m) is not None
                         and not (m == "accumulated" and request == PROBE_REQUEST)]  # fmt: skip
                if not modes or not golden.kept_whole(key):
                    continue  # kept as statistics only: each replay's record gives its power
                expected = kept_positions(golden.tensor(key), mask)
                for mode in modes:
                    found = _detectable(judges[mode], point.name, path, expected, torch_dtype)
                    if found is not None:
                        _keep_worst(worst.setdefault(path, {}), mode, found)
    return worst


def _detectable(
    judge: Judge, point: str, path: str, expected: Any, torch_dtype: Any
) -> Detectable | None:
    """The power of one comparison of the truth rounded to ``torch_dtype`` against the
    truth; None where the judge has none (an output judged exactly: ``compare.output_kind``)
    or refuses it (uncalibrated)."""
    if judge.golden.output_kind(point, path) not in CALIBRATED_KINDS:
        return None
    try:
        result = judge.compare(point, path, expected.to(torch_dtype), expected)
    except Uncalibrated:
        return None
    return result.detectable


def _keep_worst(modes: dict[str, dict[str, float]], mode: str, found: Detectable) -> None:
    """``modes[mode]`` raised to ``found`` where ``found`` catches less (each figure apart:
    the least power over calls of each kind of error)."""
    held = modes.get(mode)
    if held is None:
        modes[mode] = found.to_dict()
        return
    held["scale"] = max(held["scale"], found.scale)
    held["bias"] = max(held["bias"], found.bias)


def power_summary(power: PowerJson) -> dict[str, dict[str, dict[str, float]]]:
    """dtype -> mode -> the median and worst (largest) scale and bias over the set's point
    outputs, and their count: ``scale_median``, ``scale_worst``, ``bias_median``,
    ``bias_worst``, ``outputs`` (what ``numalign golden show`` prints)."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for dtype, points in power.items():
        by_mode: dict[str, list[dict[str, float]]] = {}
        for outputs in points.values():
            for modes in outputs.values():
                for mode, figures in modes.items():
                    by_mode.setdefault(mode, []).append(figures)
        summary[dtype] = {mode: _summarized(found) for mode, found in by_mode.items()}
    return summary


def _summarized(found: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {"outputs": float(len(found))}
    for name in ("scale", "bias"):
        values = [f[name] for f in found]
        out[f"{name}_median"] = statistics.median(values)
        out[f"{name}_worst"] = max(values)
    return out


def power_line(power: PowerJson) -> str:
    """One line of the set's power: per dtype, the median scale a pass would catch over its
    point outputs and modes (what capture and ``numalign golden power`` print)."""
    medians = []
    for dtype, points in power.items():
        scales = [figures["scale"] for outputs in points.values()
                  for modes in outputs.values() for figures in modes.values()]  # fmt: skip
        medians.append(f"{dtype} {_figure(statistics.median(scales))}")
    return "median detectable scale " + (", ".join(medians) if medians else "none (uncalibrated)")


def _figure(value: float) -> str:
    """A figure as printed: three significant digits, ``inf`` where nothing is caught."""
    return "inf" if math.isinf(value) else f"{value:.3g}"
