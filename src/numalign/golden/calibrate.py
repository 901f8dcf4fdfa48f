"""Calibration: the reference model's own error in a lower dtype, per capture point, stored in
the manifest as the control for model verdicts (DESIGN.md, rule 3).

- accumulated: the whole model in the dtype, each point's outputs against the golden ones;
- isolated: each point's module alone in the dtype, fed the golden inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.compare import compute_metrics

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet

#: The statistics kept per point and output; the worst over requests and calls.
STATS = ("max_abs", "rel_l2", "mean_abs", "ulp_p99", "max_expected")


def _stats(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    m = compute_metrics(actual, expected)
    out = {name: float(getattr(m, name)) for name in STATS}
    out["cosine"] = float(m.cosine)
    out["nonfinite"] = float(m.nan_actual + m.inf_actual - m.nan_expected - m.inf_expected)
    return out


def _worst(into: dict[str, float] | None, new: dict[str, float]) -> dict[str, float]:
    if into is None:
        return new
    merged = {k: max(into[k], new[k]) for k in into if k != "cosine"}
    merged["cosine"] = min(into["cosine"], new["cosine"])
    return merged


def _json_safe(stats: dict[str, float]) -> dict[str, float | None]:
    import math

    return {k: (v if math.isfinite(v) else None) for k, v in stats.items()}


def calibrate(
    golden: GoldenSet,
    model_dir: Path,
    dtype: str,
    *,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    device: str = "cpu",
) -> dict[str, dict[str, dict[str, Any]]]:
    """{point: {output path: {"isolated": stats, "accumulated": stats}}} for ``dtype``."""
    import torch

    from numalign.golden.capture import load_model
    from numalign.replay.layer import golden_outputs, kept_positions, replay_call, request_mask

    torch_dtype = getattr(torch, dtype)
    model = load_model(model_dir, dtype, attn_implementation=attn_implementation,
                       trust_remote_code=trust_remote_code).to(device)  # fmt: skip
    points = {p.name: p for p in golden.points}
    accumulated: dict[tuple[str, str], dict[str, float]] = {}
    isolated: dict[tuple[str, str], dict[str, float]] = {}

    for request in golden.requests:
        name = request["name"]
        inputs = {
            k: golden.tensor(v, device=device, dtype=torch_dtype)
            for k, v in request["inputs"].items()
        }

        def on_output(point: str, path: str, actual: Any, expected: Any) -> None:
            stats = _stats(actual, expected)
            accumulated[(point, path)] = _worst(accumulated.get((point, path)), stats)

        with torch.no_grad(), golden_outputs(model, golden, name, on_output):
            model(**inputs, use_cache=False)

    masks = {r["name"]: request_mask(golden, r["name"]) for r in golden.requests}
    for point in points.values():
        module = model.get_submodule(point.name)
        for request_name, calls in point.calls.items():
            mask = masks.get(request_name)
            for call in calls:
                outputs = replay_call(module, golden, call, device=device, dtype=torch_dtype)
                for path, key in call.outputs.items():
                    if path in outputs:
                        expected = kept_positions(golden.tensor(key), mask)
                        stats = _stats(kept_positions(outputs[path], mask), expected)
                        isolated[(point.name, path)] = _worst(
                            isolated.get((point.name, path)), stats
                        )

    result: dict[str, dict[str, dict[str, Any]]] = {}
    for mode, table in (("isolated", isolated), ("accumulated", accumulated)):
        for (point_name, path), stats in table.items():
            result.setdefault(point_name, {}).setdefault(path, {})[mode] = _json_safe(stats)
    return result
