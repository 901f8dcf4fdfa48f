"""A compiled model whose weights stream (``--stream --compile``, and ``--pp --compile``):
each unit's forward compiled alone, its weights held by the unit's eager hooks around the
graph (``runtime.compiled_model``, regional compilation). With ``aot_eager`` (Dynamo's graphs run
by eager kernels) the records are the eager streamed model's bit for bit, for layer, model
and decode replay, on a dense model and on an MoE whose experts stream by expert (a graph
break, counted); a backend that computes wrongly fails the compiled units and not the eager
code between them, in one process and on both pipeline ranks, whose compile time reaches
the records."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_tensor_parallel_suite import failed_tests, on_path, records, run_suite  # noqa: F401

from numalign.replay.engines.transformers import TransformersEngine
from numalign.replay.sets import open_fresh
from numalign.replay.verdict import point_record
from numalign.replay.verdict import records as verdict_records
from numalign.runtime.compiled import GraphBreakWarning
from numalign.runtime.compiled_model import CompiledModel
from numalign.session.settings import Settings, pipeline_conflicts, stream_conflicts

ROOT = Path(__file__).resolve().parents[2]
SETS = ROOT / "golden" / "sets"
CPU = torch.device("cpu")

#: A backend that computes wrongly: every floating-point output of every graph it is given
#: is 1% too large (far past float32's budgets, a few hundred ulps at most). Registered by
#: importing it (in process here; on the ranks with --device-plugin).
SCALED_BACKEND = """
import torch
from torch._dynamo import register_backend


@register_backend
def scaled_outputs(gm, example_inputs):
    def run(*args):
        out = gm(*args)
        return type(out)(
            o * 1.01 if isinstance(o, torch.Tensor) and o.is_floating_point() else o
            for o in out
        )

    return run
"""
exec(compile(SCALED_BACKEND, "scaled_backend", "exec"), {})  # registers scaled_outputs here


def _fields(rs: list[Any]) -> list[tuple[Any, ...]]:
    """What regional compilation with aot_eager must not change: identity, verdict, metrics
    (bitwise), budget."""
    return [(r.key, r.verdict, r.rule, r.metrics, r.budget, r.budget_used) for r in rs]


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[TransformersEngine, TransformersEngine]]:
    eager = TransformersEngine(Settings(dtypes=("float32",), stream=True))
    compiled = TransformersEngine(
        Settings(dtypes=("float32",), stream=True, compile_backend="aot_eager")
    )
    yield eager, compiled
    eager.close()
    compiled.close()


@pytest.mark.parametrize(
    ("name", "alone"),
    [
        ("tiny-llama", ""),  # every point alone
        # the first layer's points alone (its experts' graph break among them): each point
        # is one more compilation, and the second layer's are the first's
        ("tiny-qwen3-moe", "model.layers.0"),
    ],
)
def test_a_streamed_model_compiled_by_unit_replays_as_the_eager_one(
    engines: tuple[TransformersEngine, TransformersEngine], name: str, alone: str
) -> None:
    path = SETS / name
    compiled = engines[1]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # the MoE's experts streamed by expert: graph breaks
        replays = _replays(engines, path, alone)
    for point, (plain, regional) in replays.items():
        assert regional == plain, point
    model = compiled.cache.model_for(open_fresh(path), compiled.settings, CPU, "float32")
    assert isinstance(model, CompiledModel)
    assert "model.layers.0" in model.regions and "lm_head" in model.regions
    breaks = [w for w in seen if issubclass(w.category, GraphBreakWarning)]
    assert bool(breaks) == (name == "tiny-qwen3-moe"), [str(w.message)[:200] for w in seen]
    # the streamed model holds no weights between replays
    assert model.numalign_streamer.resident() == []


def _replays(
    engines: tuple[TransformersEngine, TransformersEngine], path: Path, alone: str
) -> dict[str, list[list[tuple[Any, ...]]]]:
    """Each replay's record fields by each engine: the model, decode, and alone every point
    whose name starts with ``alone``."""
    got: dict[str, list[list[tuple[Any, ...]]]] = {"model": [], "decode": []}
    for engine in engines:
        replayed = engine.model(path, "float32", CPU, None)
        got["model"].append(_fields(verdict_records(replayed.verdict, "t", **replayed.context)))
        assert (replayed.context["swap"] or "").endswith("stream")
        replayed = engine.decode(path, "float32", "dynamic", CPU, None)
        got["decode"].append(_fields(verdict_records(replayed.verdict, "t", **replayed.context)))
        for point in open_fresh(path).points:
            if not point.name.startswith(alone):
                continue
            replayed = engine.layer(path, point.name, "float32", CPU, None)
            records = [point_record(r, "t", **replayed.context) for r in replayed.verdict]
            got.setdefault(point.name, []).append(_fields(records))
    return got


def test_a_wrong_backend_fails_the_compiled_units_not_the_eager_code_between_them() -> None:
    path = SETS / "tiny-llama"
    engine = TransformersEngine(
        Settings(dtypes=("float32",), stream=True, compile_backend="scaled_outputs")
    )
    try:
        verdicts = {
            point: {
                point_record(r, "t").verdict
                for r in engine.layer(path, point, "float32", CPU, None).verdict
            }
            for point in ("model.layers.0.mlp", "model.layers.1", "lm_head", "model.rotary_emb")
        }
        model = engine.model(path, "float32", CPU, None)
    finally:
        engine.close()
    # a module inside a unit compiled alone, a unit, the head: wrong; the rotary embedding
    # runs eager between the units (as in the whole model): right
    assert verdicts == {
        "model.layers.0.mlp": {"failed"}, "model.layers.1": {"failed"}, "lm_head": {"failed"},
        "model.rotary_emb": {"passed"},
    }  # fmt: skip
    failing = [r.point for r in verdict_records(model.verdict, "t") if r.verdict == "failed"]
    assert failing and failing[0] == "model.embed_tokens", failing[:5]
    assert model.context["compile_s"] > 0


@pytest.mark.usefixtures("on_path")
def test_a_wrong_backend_is_caught_on_both_pipeline_ranks(pytester: pytest.Pytester) -> None:
    """--pp 2 --compile: each rank compiles the units it holds; the wrong backend fails a
    module of rank 0's layer and of rank 1's replayed alone, and the whole model; every
    record says what compiling cost on the ranks."""
    pytester.makepyfile(scaled_backend=SCALED_BACKEND)
    result = run_suite(
        pytester, "--pp", "2", "--device-plugin", "scaled_backend", "--compile",
        "scaled_outputs", "--dtype", "float32", "-k",
        "tiny-llama and not deep and (test_model or rotary or (mlp and not act_fn))",
    )  # fmt: skip
    out = result.stdout.str()
    assert failed_tests(result) == {
        "test_model[tiny-llama-float32]",
        "test_layer[tiny-llama/model.layers.0.mlp-float32]",
        "test_layer[tiny-llama/model.layers.1.mlp-float32]",
    }, out[-3000:]
    piped = records(pytester)
    assert {r.swap for r in piped} == {"compile=scaled_outputs,pp=0|1"}, out[-2000:]
    compiled = {r.test_id.split("::")[-1] for r in piped if (r.compile_s or 0) > 0}
    assert "test_layer[tiny-llama/model.layers.1.mlp-float32]" in compiled, compiled


def test_a_swapped_wrong_kernel_is_caught_in_a_streamed_model_compiled_by_unit(
    wrong_kernel: str,
) -> None:
    """The swap settles on the unit's weights, eager, before the unit's graph runs (no probe
    is traced); the wrong norm fails alone (compiled alone, its unit held) and is the first
    divergence of the whole model, local."""
    path = SETS / "tiny-llama"
    engine = TransformersEngine(
        Settings(dtypes=("float32",), stream=True, compile_backend="aot_eager",
                 swaps=(wrong_kernel,))
    )  # fmt: skip
    try:
        alone = engine.layer(path, "model.layers.1.input_layernorm", "float32", CPU, None)
        model = engine.model(path, "float32", CPU, None)
    finally:
        engine.close()
    assert {point_record(r, "t").verdict for r in alone.verdict} == {"failed"}
    recorded = verdict_records(model.verdict, "t", **model.context)
    assert {r.swap for r in recorded} == {f"{wrong_kernel},compile=aot_eager,stream"}
    divergence = next(r.first_divergence for r in recorded if r.first_divergence)
    assert (divergence["point"], divergence["kind"]) == ("model.layers.0.input_layernorm", "local")


def test_stream_and_pipeline_ranks_take_compile_but_pipeline_ranks_not_tensor_parallel() -> None:
    assert stream_conflicts(Settings(stream=True, compile_backend="inductor")) is None
    assert pipeline_conflicts(Settings(pp=2, compile_backend="inductor")) is None
    conflict = pipeline_conflicts(Settings(pp=2, tp=2, compile_backend="inductor"))
    assert conflict is not None and "together with --tp yet" in conflict
