"""vLLM's CPU fused MoE kernel measured directly (``replay.engines.vllm_kernels``): where it
rounds bfloat16 toward zero (CPUs without AMX or AVX512-BF16: docs/vllm.md), tiny-mixtral's
MoE blocks alone fail in bfloat16 as expected failures naming the measurement; where it
rounds to nearest they pass; a bug planted on top fails on every CPU.

Runs where vLLM is installed (CI's vLLM environment); elsewhere it skips with that reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (CI runs this in its vLLM venv)")

import torch

from numalign.replay.engines.vllm import VllmEngine
from numalign.replay.engines.vllm_kernels import moe_scale
from numalign.replay.sets import open_fresh

ROOT = Path(__file__).resolve().parents[2]
MIXTRAL = ROOT / "golden" / "sets" / "tiny-mixtral"
BLOCK = "model.layers.0.mlp"
CPU = torch.device("cpu")


def _running(engine: VllmEngine) -> Any:
    return engine._engine(open_fresh(MIXTRAL), "bfloat16")


def _points(running: Any) -> dict[str, str]:
    return {pm.point: pm.module for pm in running.mapping if pm.module is not None}


def test_the_kernels_rounding_explains_exactly_the_blocks_failures(engine: VllmEngine) -> None:
    replayed = engine.layer(MIXTRAL, BLOCK, "bfloat16", CPU, None)
    running = _running(engine)
    known = moe_scale(running.model, _points(running), "bfloat16")
    failed = [r for r in replayed.verdict if not r.result.passed]
    if known is None:  # the kernel rounds to nearest on this CPU (AMX, or AVX512-BF16)
        assert not failed, "an MoE block fails where vLLM's kernel rounds to nearest"
        assert replayed.known is None
        return
    # the blocks, not the decoder layers that add the residual to them
    assert BLOCK in known.points and "model.layers.0" not in known.points
    # rounding toward zero twice (the activation, the output) shrinks by 0.4 to 0.7%
    assert 0.993 < known.low <= known.high < 0.996
    if failed:
        assert replayed.known is not None and "rounds toward zero" in replayed.known


def test_float32_has_no_known_scale(engine: VllmEngine) -> None:
    running = _running(engine)
    assert moe_scale(running.model, _points(running), "float32") is None


def test_a_scale_planted_on_the_block_fails_on_every_cpu(engine: VllmEngine) -> None:
    running = _running(engine)
    module = running.model.get_submodule(_points(running)[BLOCK])

    def larger(mod: Any, args: Any, out: Any) -> Any:
        return out * 1.02  # 2%: beyond the honest range and the kernel's own shrink

    handle = module.register_forward_hook(larger)
    try:
        replayed = engine.layer(MIXTRAL, BLOCK, "bfloat16", CPU, None)
    finally:
        handle.remove()
    assert any(not r.result.passed for r in replayed.verdict)
    assert replayed.known is None
