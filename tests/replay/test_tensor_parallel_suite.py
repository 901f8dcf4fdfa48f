"""The model suites run tensor-parallel for real (pytester, in a subprocess, as users run
them: ``--tp 2``, two gloo ranks under torchrun): an honest sharded replay passes layer by
layer, end to end and in decode, its records naming ``tp=2``; a row-parallel projection
whose all-reduce is done twice is flagged at its own module as the first divergence, while
the same kernels on one process (``--tp 1``) pass; a rank that dies is a crashed record and
the next test runs on a fresh group; a model whose heads do not divide is a usage error
naming the numbers."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from numalign.records.drift import read_records

ROOT = Path(__file__).resolve().parents[2]
SUITES = ROOT / "suites" / "models"

#: A sharding bug: model.layers.1.self_attn.o_proj (row-parallel) all-reduces its partial
#: sums twice, so its output is N times too large. Loaded as --device-plugin, so every rank
#: imports it; it touches only what transformers' tensor-parallel loading installs.
DOUBLE_ALL_REDUCE = """
import torch.distributed as dist
from transformers.distributed import mixin, tensor_parallel

BROKEN = "model.layers.1.self_attn.o_proj"
apply = mixin.apply_tensor_parallelism
post = tensor_parallel.RowwiseParallel.transform_output_post_forward


def apply_and_mark(model, mesh, plan):
    model = apply(model, mesh, plan)
    model.get_submodule(BROKEN).numalign_broken = True
    return model


def reduce_twice(self, module, output, mesh):
    output = post(self, module, output, mesh)
    if getattr(module, "numalign_broken", False):
        dist.all_reduce(output)
    return output


mixin.apply_tensor_parallelism = apply_and_mark
tensor_parallel.RowwiseParallel.transform_output_post_forward = reduce_twice
"""

#: A rank that dies: rank 1 exits in layer 1's MLP, in float32 only (the bfloat16 test that
#: follows runs on a fresh group).
RANK_DIES = """
import os

import torch
import torch.distributed as dist
from transformers.models.llama import modeling_llama

forward = modeling_llama.LlamaMLP.forward


def dying(self, x):
    if x.dtype == torch.float32 and dist.is_initialized() and dist.get_rank() == 1:
        os._exit(7)
    return forward(self, x)


modeling_llama.LlamaMLP.forward = dying
"""


@pytest.fixture
def on_path(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(  # this tree's src first, then the caller's path
        "PYTHONPATH", os.pathsep.join(filter(None, [str(pytester.path), str(ROOT / "src"),
                                                     str(ROOT), os.environ.get("PYTHONPATH")]))
    )  # fmt: skip


def run_suite(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        str(SUITES), "--rootdir", str(ROOT), "-p", "no:cacheprovider",
        "--report-dir", str(pytester.path / "reports"), "-q", "--tb=line", "-rfs",
        "--cache-implementation", "dynamic", *args,
    )  # fmt: skip


def failed_tests(result: pytest.RunResult) -> set[str]:
    return set(re.findall(r"FAILED \S+::(test_\w+\[[^\]]+\])", result.stdout.str()))


def records(pytester: pytest.Pytester) -> list:
    run = next((pytester.path / "reports").iterdir())
    return read_records(run / "records.jsonl")


#: tiny-llama in float32: every layer, the whole model and decode with a dynamic cache.
TINY_LLAMA = ("--dtype", "float32", "-k", "tiny-llama and not deep")


def test_an_honest_tensor_parallel_replay_passes(pytester: pytest.Pytester, on_path: None) -> None:
    result = run_suite(pytester, "--tp", "2", *TINY_LLAMA)
    out = result.stdout.str()
    # 16 capture points (the mask, the rotary embedding and the activation's probe point
    # among them), the model, decode with the dynamic cache
    result.assert_outcomes(passed=18)
    recorded = records(pytester)
    assert {r.swap for r in recorded} == {"tp=2", "tp=2,cache=dynamic"}, out[-2000:]
    assert all(r.verdict == "passed" for r in recorded)


def test_an_all_reduce_done_twice_is_caught_at_its_module(
    pytester: pytest.Pytester, on_path: None
) -> None:
    pytester.makepyfile(double_all_reduce=DOUBLE_ALL_REDUCE)
    plant = ("--device-plugin", "double_all_reduce")
    result = run_suite(pytester, "--tp", "2", *plant, *TINY_LLAMA)
    out = result.stdout.str()
    # the module alone (and the decoder layer holding it), the whole model and decode fail;
    # every other layer passes
    assert failed_tests(result) == {
        "test_layer[tiny-llama/model.layers.1.self_attn-float32]",
        "test_layer[tiny-llama/model.layers.1-float32]",
        "test_model[tiny-llama-float32]",
        "test_decode[tiny-llama-float32-dynamic]",
    }, out[-3000:]
    assert "first divergence at model.layers.1.self_attn" in out
    model = [r for r in records(pytester) if r.test_id.endswith("test_model[tiny-llama-float32]")]
    divergence = next(r.first_divergence for r in model if r.first_divergence)
    assert divergence["point"] == "model.layers.1.self_attn" and divergence["kind"] == "local"

    # the same plugin on one process: nothing is sharded, nothing is reduced, all pass
    single = run_suite(pytester, "--tp", "1", *plant, *TINY_LLAMA)
    single.assert_outcomes(passed=18)


def test_a_streamed_tensor_parallel_replay_shards_each_unit_and_catches_the_same_bug(
    pytester: pytest.Pytester, on_path: None
) -> None:
    """--tp 2 --stream: each rank reads only its shard of each unit as the unit runs
    (``golden.stream``, transformers' plan applied to the skeleton); the honest replay
    passes, and the all-reduce done twice, which only a sharded model's hooks run, fails
    the same tests as unstreamed."""
    result = run_suite(pytester, "--tp", "2", "--stream", *TINY_LLAMA)
    out = result.stdout.str()
    result.assert_outcomes(passed=18)
    assert {r.swap for r in records(pytester)} == {"tp=2,stream", "tp=2,stream,cache=dynamic"}, out[
        -2000:
    ]
    pytester.makepyfile(double_all_reduce=DOUBLE_ALL_REDUCE)
    result = run_suite(pytester, "--tp", "2", "--stream", "--device-plugin",
                       "double_all_reduce", *TINY_LLAMA)  # fmt: skip
    assert failed_tests(result) == {
        "test_layer[tiny-llama/model.layers.1.self_attn-float32]",
        "test_layer[tiny-llama/model.layers.1-float32]",
        "test_model[tiny-llama-float32]",
        "test_decode[tiny-llama-float32-dynamic]",
    }, result.stdout.str()[-3000:]


def test_a_rank_that_dies_is_a_crashed_record_and_the_session_goes_on(
    pytester: pytest.Pytester, on_path: None
) -> None:
    pytester.makepyfile(rank_dies=RANK_DIES)
    result = run_suite(
        pytester, "--tp", "2", "--device-plugin", "rank_dies", "--dtype", "float32,bfloat16",
        "-k", "test_model and tiny-llama and not deep",
    )  # fmt: skip
    out = result.stdout.str()
    assert failed_tests(result) == {"test_model[tiny-llama-float32]"}, out[-3000:]
    assert "rank 1 of 2 died" in out
    crashed = [r for r in records(pytester) if r.verdict == "crashed"]
    assert [r.test_id.split("::")[-1] for r in crashed] == ["test_model[tiny-llama-float32]"]
    assert "rank 1 of 2 died" in crashed[0].reason and crashed[0].swap == "tp=2"
    # bfloat16 ran after the crash, on a fresh group, and passed
    result.assert_outcomes(passed=1, failed=1)


def test_heads_that_do_not_divide_fail_with_the_numbers(
    pytester: pytest.Pytester, on_path: None
) -> None:
    result = run_suite(
        pytester, "--tp", "3", "--dtype", "float32", "-k", "test_model and tiny-llama and not deep"
    )
    out = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "tiny-llama cannot be split over --tp 3 ranks: its 4 attention heads" in out
    (error,) = records(pytester)
    assert error.verdict == "error" and error.error == "TensorParallelUsageError"
