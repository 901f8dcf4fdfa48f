"""The serving matrix through vLLM (issue 41): every arrangement serves the same golden rows
and is judged against the set's budgets; an arrangement the set cannot exercise skips with
what it lacks; a bug planted into one serving path (a prefix-cache hit that reads another
block) fails in its arrangement, at the module where it lives, and not in the plain one.

Runs where vLLM is installed (CI's vLLM environment); elsewhere it skips with that reason.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (CI runs this in its vLLM venv)")

import torch

from numalign.replay.engines.errors import EngineUnsupported
from numalign.replay.engines.serving import ARRANGEMENTS
from numalign.replay.engines.vllm import VllmEngine
from numalign.replay.engines.vllm_serving import KV_BLOCK
from numalign.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
MISTRAL = ROOT / "golden" / "sets" / "tiny-mistral"
CPU = torch.device("cpu")
#: Long rows: past two KV blocks (the arrangements that work in whole blocks need them).
LONG = 2 * KV_BLOCK + KV_BLOCK // 4


@pytest.fixture(scope="module")
def engine() -> Iterator[VllmEngine]:
    engine = VllmEngine(Settings(engine="vllm"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def long_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-mixtral (full attention: no sliding window frees blocks) captured with rows of
    LONG tokens, float32 calibrated (the budgets the judge uses)."""
    out = tmp_path_factory.mktemp("sets") / "tiny-mixtral-long"
    command = [sys.executable, "-m", "numalign.cli", "capture",
               str(ROOT / "golden" / "models" / "tiny-mixtral"), "--out", str(out),
               "--long", str(LONG), "--calibrate", "float32"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _served(engine: VllmEngine, path: Path, name: str) -> Any:
    """The model and decode verdicts of ``path`` served in arrangement ``name``, and what
    the engine was seen doing."""
    engine._served.clear()  # a fresh serving: a plant changes what the engine computes
    model = engine.model(path, "float32", CPU, None, serving=name)
    decode = engine.decode(path, "float32", "paged", CPU, None, serving=name)
    exercised = next(s for k, s in engine._served.items() if k[2] == name).exercised
    return model, decode, exercised


@pytest.mark.parametrize("name", ["alone", "crowded", "chunked-8", "unchunked", "prefill-scored"])
def test_each_arrangement_of_the_zoo_set_passes_and_names_itself(
    engine: VllmEngine, name: str
) -> None:
    model, decode, exercised = _served(engine, MISTRAL, name)
    assert model.verdict.passed, model.verdict.message(name)
    assert decode.verdict.passed, decode.verdict.message(name)
    assert model.context["engine_variant"].endswith(f",vllm-serving={name}")
    if name == "crowded":  # the rows among their copies: the engine's largest batch ran
        assert exercised.most_rows == ARRANGEMENTS[name].rows
    if name == "chunked-8":  # every zoo prompt has more than 8 tokens
        assert exercised.chunked_prompts == 8
    if name == "alone":
        assert exercised.most_rows == 1


def test_the_default_arrangement_keeps_the_records_of_before(engine: VllmEngine) -> None:
    model, _, exercised = _served(engine, MISTRAL, "batched")
    assert model.verdict.passed
    assert "vllm-serving" not in model.context["engine_variant"]
    # 32 tokens a step: the 24-token rows share steps with others and are cut in chunks
    assert exercised.chunked_prompts > 0 and exercised.most_rows > 1


@pytest.mark.parametrize("name", ["prefix-cached", "preempted"])
def test_an_arrangement_the_set_cannot_exercise_skips_saying_what_it_lacks(
    engine: VllmEngine, name: str
) -> None:
    # the zoo's rows have at most 24 tokens: no full block of 32 to share or to compete for
    with pytest.raises(EngineUnsupported, match=f"capture the set .*--long {LONG}"):
        engine.model(MISTRAL, "float32", CPU, None, serving=name)


def test_prefix_hits_and_preemption_are_served_and_judged(
    engine: VllmEngine, long_set: Path
) -> None:
    model, decode, exercised = _served(engine, long_set, "prefix-cached")
    assert model.verdict.passed and decode.verdict.passed
    # every row of the second round hits its full blocks: at least the two shared blocks of
    # each LONG-token row (long-leftpad#0 and long-rightpad#0 are the same tokens)
    assert exercised.prefix_hit_tokens >= 2 * 2 * KV_BLOCK
    model, decode, exercised = _served(engine, long_set, "preempted")
    assert model.verdict.passed and decode.verdict.passed
    assert exercised.preemptions > 0


def test_a_prefix_hit_reading_another_block_fails_in_its_arrangement_only(
    engine: VllmEngine, long_set: Path
) -> None:
    plain, _, _ = _served(engine, long_set, "batched")
    assert plain.verdict.passed
    running = engine._engine(_open(long_set), "float32", ARRANGEMENTS["prefix-cached"])
    runner = running.runner
    execute = runner.execute_model

    def stale_first_block(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        # a row that hits the cache reads its first block from the next block of the pool
        for new in scheduler_output.scheduled_new_reqs:
            if new.num_computed_tokens:
                first, *rest = new.block_ids[0]
                new.block_ids = ([first + 1, *rest], *new.block_ids[1:])
        return execute(scheduler_output, *args, **kwargs)

    runner.execute_model = stale_first_block
    try:
        planted, _, exercised = _served(engine, long_set, "prefix-cached")
    finally:
        runner.execute_model = execute
    assert exercised.prefix_hit_tokens > 0
    verdict = planted.verdict
    assert not verdict.passed
    # attention is the first module that reads the cache: the first divergence (unlocated:
    # vLLM's attention does not run alone, see docs/vllm.md)
    assert verdict.divergence is not None
    assert verdict.divergence.point == "model.layers.0.self_attn", verdict.message("planted")


def _open(path: Path) -> Any:
    from numalign.replay.model import open_fresh

    return open_fresh(path)
