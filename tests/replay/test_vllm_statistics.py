"""A golden set that keeps statistics only at most points (``numalign capture --full-points``)
replayed through vLLM: the engine hands the judge the statistics where the set keeps no
tensor, so honest vLLM passes with those records judged on statistics, a bug planted in
vLLM's module at such a point fails there saying so, and a point whose inputs are statistics
is not run alone (skipped, saying which tensor), while a full point still is.

Runs where vLLM is installed (CI's vLLM environment); elsewhere it skips with that reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (CI runs this in its vLLM venv)")

import torch

from numalign.golden.capture_spec import CaptureSpec
from numalign.golden.statistics_info import StatisticsOnly
from numalign.replay.engines.vllm import VllmEngine
from numalign.replay.ensemble import capture_calibrated
from numalign.replay.sets import open_fresh

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "golden" / "models" / "tiny-mistral"
#: 64 buckets: tiny-mistral's outputs (24 x 64 values a request) are larger than twice that,
#: so every point but the full ones is kept as statistics.
SPEC = CaptureSpec(continuation=0, decode_steps=0, long=0, far=0, probes=False,
                   progress=False, sketch_width=64,
                   full_points=("model.embed_tokens", "model.layers.0", "model.layers.0.*"),
                   )  # fmt: skip
#: A point kept as statistics only whose inputs are statistics too.
STATS_POINT = "model.layers.1.mlp"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def golden_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vllm-statistics") / "tiny-mistral"
    capture_calibrated(MODEL, out, SPEC, calibrate=["bfloat16"])
    return out


def _model(engine: VllmEngine, path: Path) -> Any:
    engine._served.clear()  # a fresh serving: a plant changes what the engine computes
    return engine.model(path, "bfloat16", CPU, None).verdict


def test_honest_vllm_passes_a_statistics_set(engine: VllmEngine, golden_path: Path) -> None:
    verdict = _model(engine, golden_path)
    assert verdict.passed, verdict.message("tiny-mistral (statistics) [bfloat16]")
    at_point = [r for r in verdict.points if r.point == STATS_POINT]
    assert at_point and all("judged on statistics only" in r.result.reason for r in at_point)
    # the full points are judged by their tensors, as before
    whole = [r for r in verdict.points if r.point == "model.layers.0"]
    assert whole and not any("statistics only" in r.result.reason for r in whole)


def test_a_bug_in_vllms_module_at_a_statistics_point_fails_there(
    engine: VllmEngine, golden_path: Path
) -> None:
    running = engine._engine(open_fresh(golden_path), "bfloat16")
    module = next(pm.module for pm in running.mapping if pm.point == STATS_POINT)

    def larger(mod: Any, args: Any, out: Any) -> Any:
        return out * 1.05  # 5%: beyond any bfloat16 budget and the 26.5% sketch margin

    handle = running.model.get_submodule(module).register_forward_hook(larger)
    try:
        verdict = _model(engine, golden_path)
    finally:
        handle.remove()
        engine._served.clear()  # what the plant served is not kept for other tests
    divergence = verdict.divergence
    assert divergence is not None and divergence.point == STATS_POINT
    assert "judged on statistics only" in divergence.result.reason
    # its inputs are statistics: it cannot run alone, and the verdict says why
    assert divergence.kind == "unlocated" and "statistics only" in (divergence.why_unlocated or "")


def test_a_point_fed_statistics_is_not_run_alone(engine: VllmEngine, golden_path: Path) -> None:
    with pytest.raises(StatisticsOnly, match="--full-points"):
        engine.layer(golden_path, STATS_POINT, "bfloat16", CPU, None)


def test_a_full_point_still_runs_alone(engine: VllmEngine, golden_path: Path) -> None:
    replayed = engine.layer(golden_path, "model.layers.0.mlp", "bfloat16", CPU, None)
    assert replayed.verdict and all(r.result.passed for r in replayed.verdict)
