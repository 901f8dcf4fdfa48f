"""The serving matrix through vLLM (issue 41): every arrangement serves the same golden rows
and is judged against the set's budgets; an arrangement the set cannot exercise skips with
what it lacks; a bug planted into one serving path (a prefix-cache hit that reads another
block) fails in its arrangement, at the module where it lives, and not in the plain one.

Runs where vLLM is installed (CI's vLLM environment); elsewhere it skips with that reason.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (CI runs this in its vLLM venv)")

import torch

from numalign.replay.engines.errors import EngineUnsupported
from numalign.replay.engines.vllm import VllmEngine
from numalign.replay.engines.vllm_serving import KV_BLOCK
from numalign.runtime.serving import ARRANGEMENTS

ROOT = Path(__file__).resolve().parents[2]
MISTRAL = ROOT / "golden" / "sets" / "tiny-mistral"
MIXTRAL = ROOT / "golden" / "sets" / "tiny-mixtral"
CPU = torch.device("cpu")


def _served(engine: VllmEngine, path: Path, name: str) -> Any:
    """The model and decode verdicts of ``path`` served in arrangement ``name``, and what
    the engine was seen doing."""
    engine._served.clear()  # a fresh serving: a plant changes what the engine computes
    model = engine.model(path, "float32", CPU, None, serving=name)
    decode = engine.decode(path, "float32", "paged", CPU, None, serving=name)
    exercised = next(s for k, s in engine._served.items() if k[2] == name).exercised
    return model, decode, exercised


@pytest.mark.parametrize(
    "name", ["alone", "crowded", "chunked-8", "unchunked", "prefill-scored", "speculative"]
)
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
    if name == "speculative":  # 4 decode rows, 3 drafts each (4 steps: one verification)
        assert exercised.drafted_tokens == 4 * 3


def test_the_default_arrangement_keeps_the_records_of_before(engine: VllmEngine) -> None:
    model, _, exercised = _served(engine, MISTRAL, "batched")
    assert model.verdict.passed
    assert "vllm-serving" not in model.context["engine_variant"]
    # 32 tokens a step: the 24-token rows share steps with others and are cut in chunks
    assert exercised.chunked_prompts > 0 and exercised.most_rows > 1


@pytest.mark.parametrize("name", ["prefix-cached", "preempted"])
def test_an_arrangement_vllm_did_not_exercise_skips_saying_what_the_set_lacks(
    engine: VllmEngine, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from numalign.replay.engines import vllm_serving

    # the scheduler seen doing nothing: as with rows that fill no KV block
    monkeypatch.setattr(vllm_serving.Exercised, "saw", lambda self, output: None)
    engine._served.clear()
    with pytest.raises(EngineUnsupported, match=f"capture the set .*--long {2 * KV_BLOCK + 8}"):
        engine.model(MIXTRAL, "float32", CPU, None, serving=name)
    engine._served.clear()


@pytest.mark.parametrize("path", [MISTRAL, MIXTRAL], ids=lambda p: p.name)
def test_the_zoo_sets_are_served_from_the_prefix_cache_and_preempted(
    engine: VllmEngine, path: Path
) -> None:
    model, decode, exercised = _served(engine, path, "prefix-cached")
    assert model.verdict.passed and decode.verdict.passed
    # the padded requests' identical first rows (40 tokens, long-leftpad#0 and
    # long-rightpad#0; text-*#0 have 16) share one full block of 32 tokens, hit once per
    # row and round: at least the second round's two hits
    assert exercised.prefix_hit_tokens >= 2 * KV_BLOCK
    model, decode, exercised = _served(engine, path, "preempted")
    assert model.verdict.passed and decode.verdict.passed
    assert exercised.preemptions > 0


def test_a_prefix_hit_reading_another_block_fails_in_its_arrangement_only(
    engine: VllmEngine,
) -> None:
    plain, _, _ = _served(engine, MIXTRAL, "batched")
    assert plain.verdict.passed
    running = engine._engine(_open(MIXTRAL), "float32", ARRANGEMENTS["prefix-cached"])
    runner = running.runner
    execute = runner.execute_model

    firsts: list[tuple[list[int], int]] = []  # each request's first tokens and first block

    def stale_first_block(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        # a row that hits the cache reads its first block from another request's first block
        # (one whose tokens differ): the cache handed out a block of another request
        for new in scheduler_output.scheduled_new_reqs:
            head, (first, *rest) = new.prompt_token_ids[:KV_BLOCK], new.block_ids[0]
            other = next((b for t, b in firsts if t != head), None)
            if new.num_computed_tokens and other is not None:
                new.block_ids = ([other, *rest], *new.block_ids[1:])
            firsts.append((head, first))
        return execute(scheduler_output, *args, **kwargs)

    runner.execute_model = stale_first_block
    try:
        planted, _, exercised = _served(engine, MIXTRAL, "prefix-cached")
    finally:
        runner.execute_model = execute
    assert exercised.prefix_hit_tokens > 0
    verdict = planted.verdict
    assert not verdict.passed
    # attention is the first module that reads the cache: the first divergence (unlocated:
    # vLLM's attention does not run alone, see docs/vllm.md)
    assert verdict.divergence is not None
    assert verdict.divergence.point == "model.layers.0.self_attn", verdict.message("planted")


def test_a_preempted_row_recomputed_at_shifted_positions_fails_in_its_arrangement_only(
    engine: VllmEngine,
) -> None:
    plain, _, _ = _served(engine, MIXTRAL, "batched")
    assert plain.verdict.passed
    running = engine._engine(_open(MIXTRAL), "float32", ARRANGEMENTS["preempted"])

    def resumed(output: Any, rid: str) -> slice | None:
        # the recompute of a resumed row rotated one position on: its keys cached wrong
        return slice(None) if rid in output.scheduled_cached_reqs.resumed_req_ids else None

    with _rotary_shifted(running, resumed):
        planted, _, exercised = _served(engine, MIXTRAL, "preempted")
    assert exercised.preemptions > 0
    assert not planted.verdict.passed
    assert planted.verdict.divergence is not None
    assert planted.verdict.divergence.point == "model.layers.0.self_attn"


def test_a_speculative_verification_at_shifted_positions_fails_in_its_arrangement_only(
    engine: VllmEngine,
) -> None:
    plain, plain_decode, _ = _served(engine, MIXTRAL, "batched")
    assert plain.verdict.passed and plain_decode.verdict.passed
    running = engine._engine(_open(MIXTRAL), "float32", ARRANGEMENTS["speculative"])

    def drafted(output: Any, rid: str) -> slice | None:
        # the drafted tokens of a verification rotated one position on (the row's own
        # token, the first, keeps its place)
        return slice(1, None) if output.scheduled_spec_decode_tokens.get(rid) else None

    try:
        with _rotary_shifted(running, drafted):
            _, planted, exercised = _served(engine, MIXTRAL, "speculative")
    except EngineUnsupported as exc:  # the wrong logits led a row off the golden tokens
        pytest.fail(f"the planted verification changed the greedy tokens: {exc}")
    assert exercised.drafted_tokens > 0
    verdict = planted.verdict
    assert not verdict.passed
    # the first decode step is the row's own token; the drafts are steps 2 on
    assert verdict.divergence is not None
    assert (verdict.divergence.step, verdict.divergence.point) == (2, "model.layers.0.self_attn")


def test_a_prompt_chunk_after_the_first_at_shifted_positions_fails_chunked_not_unchunked(
    engine: VllmEngine,
) -> None:
    def shifted(module: Any, args: tuple[Any, ...]) -> Any:
        # a prompt's later chunks rotated one position on: the chunk boundary moved them
        from vllm.forward_context import get_forward_context

        runner = engine._running.runner  # type: ignore[union-attr]
        metadata = next(iter(get_forward_context().attn_metadata.values()))
        starts = metadata.query_start_loc.tolist()
        prompts = [len(runner.requests[r].prompt_token_ids) for r in runner.input_batch.req_ids]
        positions = args[0].clone()
        for (begin, end), prompt in zip(itertools.pairwise(starts), prompts, strict=False):
            if 0 < int(positions[begin]) < prompt:  # a prompt chunk that is not the first
                positions[begin:end] += 1
        return (positions, *args[1:])

    verdicts = {}
    for name in ("chunked-8", "unchunked"):  # each arrangement's engine planted alike
        running = engine._engine(_open(MIXTRAL), "float32", ARRANGEMENTS[name])
        rotary = running.model.get_submodule("model.layers.0.self_attn.rotary_emb")
        handle = rotary.register_forward_pre_hook(shifted)
        try:
            model, _, exercised = _served(engine, MIXTRAL, name)
        finally:
            handle.remove()
        verdicts[name] = model.verdict
        assert (exercised.chunked_prompts > 0) == (name == "chunked-8")
    planted = verdicts["chunked-8"]
    assert not planted.passed
    assert planted.divergence is not None
    assert planted.divergence.point == "model.layers.0.self_attn"
    # a prompt prefilled whole has no later chunk: the plant never fires
    assert verdicts["unchunked"].passed, verdicts["unchunked"].message("unchunked")


@contextmanager
def _rotary_shifted(running: Any, part: Callable[[Any, str], slice | None]) -> Iterator[None]:
    """Every layer's rotary embedding planted: the part of each row's scheduled tokens that
    ``part`` picks from the step's scheduler output (None: none of them) rotated one position
    on."""
    runner, step = running.runner, {}
    execute = runner.execute_model

    def note_step(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        step["output"] = scheduler_output
        return execute(scheduler_output, *args, **kwargs)

    def shifted(module: Any, args: tuple[Any, ...]) -> Any:
        output, (positions, start) = step["output"], (args[0].clone(), 0)
        for rid in runner.input_batch.req_ids:
            count = output.num_scheduled_tokens.get(rid, 0)
            chosen = part(output, rid)
            if chosen is not None:
                positions[start : start + count][chosen] += 1  # a view: in place
            start += count
        return (positions, *args[1:])

    handles = [m.register_forward_pre_hook(shifted) for n, m in running.model.named_modules()
               if n.endswith("self_attn.rotary_emb")]  # fmt: skip
    runner.execute_model = note_step
    try:
        yield
    finally:
        runner.execute_model = execute
        for handle in handles:
            handle.remove()


def _open(path: Path) -> Any:
    from numalign.replay.sets import open_fresh

    return open_fresh(path)
