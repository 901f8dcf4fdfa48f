"""Pipeline-parallel replay (``--pp N``) for real: the model suites in a subprocess, as users
run them, the ranks gloo processes under torchrun. An honest replay over two ranks judges
every point as one process does, record for record and number for number; a boundary
that loses precision between the ranks is caught at the first layer past it, its input at
fault named, while every layer replayed alone passes; a split the model cannot take is
refused with the numbers; the layers split as vLLM splits them."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
from test_tensor_parallel_suite import failed_tests, on_path, records, run_suite  # noqa: F401

from numalign.compare.calibration import CACHE_POINT
from numalign.replay.pipeline import load_stage
from numalign.replay.pipeline_split import (
    PipelineUnsupported,
    PipelineUsageError,
    check_pipelinable,
    layout,
    split_layers,
)
from numalign.replay.wire import digest
from numalign.session.settings import Settings, pipeline_conflicts

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "golden" / "models"

#: tiny-llama in float32: every layer, the whole model and decode with a dynamic cache; its
#: two decoder layers split one per rank under --pp 2.
TINY_LLAMA = ("--dtype", "float32", "-k", "tiny-llama and not deep")

#: A boundary bug: the hidden states rank 0 sends to rank 1 are rounded to bfloat16 on the
#: way (a transport that packs activations to half the bytes). Loaded as --device-plugin,
#: so every rank imports it.
LOSSY_BOUNDARY = """
import torch

from numalign.replay import pipeline

send = pipeline.send_tensor


def send_rounded(tensor, to):
    send(tensor.to(torch.bfloat16).to(tensor.dtype), to)


pipeline.send_tensor = send_rounded
"""


def by_key(recorded: list) -> dict:
    return {(r.test_id, r.point, r.request, r.step, r.output, r.call): r for r in recorded}


@pytest.mark.usefixtures("on_path")
def test_an_honest_pipeline_replay_judges_as_one_process(pytester: pytest.Pytester) -> None:
    result = run_suite(pytester, "--pp", "2", *TINY_LLAMA)
    out = result.stdout.str()
    # 16 capture points (the mask, the rotary embedding and the activation's probe point
    # among them), the model, decode with the dynamic cache
    result.assert_outcomes(passed=18)
    piped = records(pytester)
    # the records name the layers each rank holds
    assert {r.swap for r in piped} == {"pp=0|1", "pp=0|1,cache=dynamic"}, out[-2000:]

    shutil.rmtree(pytester.path / "reports")
    run_suite(pytester, *TINY_LLAMA).assert_outcomes(passed=18)
    single = records(pytester)
    # the same records in the same order: every rank's points merged as one process judges
    assert list(by_key(piped)) == list(by_key(single))
    for key, one in by_key(single).items():
        split = by_key(piped)[key]
        assert split.verdict == one.verdict, key
        for name, value in (one.metrics or {}).items():
            other = split.metrics[name]
            if isinstance(value, float):
                # the same kernels on the same inputs: the tensors are bitwise equal; their
                # float64 statistics may differ in the last bits (a rank sums with another
                # thread count than one process), 1e-12 is far above that and far below
                # any drift
                assert math.isclose(other, value, rel_tol=1e-12, abs_tol=1e-300), (key, name)
            else:
                assert other == value, (key, name)


#: tiny-qwen3-next's decode in float32: linear and full attention layers alternate, so under
#: --pp 2 each rank holds one linear-attention layer and one attention layer.
QWEN3_NEXT_DECODE = ("--dtype", "float32", "-k", "tiny-qwen3-next and test_decode")


@pytest.mark.usefixtures("on_path")
def test_a_linear_attention_decode_judges_its_states_on_their_ranks_as_one_process(
    pytester: pytest.Pytester,
) -> None:
    run_suite(pytester, "--pp", "2", *QWEN3_NEXT_DECODE).assert_outcomes(passed=1)
    piped = by_key(records(pytester))
    shutil.rmtree(pytester.path / "reports")
    run_suite(pytester, *QWEN3_NEXT_DECODE).assert_outcomes(passed=1)
    single = by_key(records(pytester))
    # every cache state judged, each on the rank that holds its layer: the linear layers'
    # conv and recurrent states among them
    states = {key[4] for key in single if key[1].startswith(CACHE_POINT)}
    assert {"layers.0.conv_states.0", "layers.2.recurrent_states.0"} <= states, states
    assert list(piped) == list(single)
    for key, one in single.items():
        assert piped[key].verdict == one.verdict == "passed", key
        for name, value in (one.metrics or {}).items():
            if isinstance(value, float):  # as in the honest replay above
                assert math.isclose(piped[key].metrics[name], value, rel_tol=1e-12,
                                    abs_tol=1e-300), (key, name)  # fmt: skip


@pytest.mark.usefixtures("on_path")
def test_a_lossy_boundary_is_caught_past_it_while_the_layers_pass(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(lossy_boundary=LOSSY_BOUNDARY)
    plant = ("--device-plugin", "lossy_boundary")
    result = run_suite(pytester, "--pp", "2", *plant, *TINY_LLAMA)
    out = result.stdout.str()
    # each layer replayed alone crosses no boundary and passes; the whole model and decode,
    # whose activations cross it, fail
    assert failed_tests(result) == {
        "test_model[tiny-llama-float32]",
        "test_decode[tiny-llama-float32-dynamic]",
    }, out[-3000:]
    model = [r for r in records(pytester) if r.test_id.endswith("test_model[tiny-llama-float32]")]
    failing = [r.point for r in model if r.verdict == "failed"]
    # rank 0's layer judged before the boundary passes; the first point past it fails
    assert "model.layers.0" not in failing
    assert failing[0].startswith("model.layers.1"), failing
    divergence = next(r.first_divergence for r in model if r.first_divergence)
    # the first point past the boundary fails in the whole model and passes alone; its
    # input at fault is what arrived at rank 1, whose checksum is not the one rank 0 sent
    assert divergence["point"].startswith("model.layers.1"), divergence
    assert divergence["kind"] == "input", divergence
    assert divergence["inputs"] == ["hidden states model.layers.1 received from pipeline rank 0"], (
        divergence
    )
    assert "changed on the way from rank 0 to rank 1" in out

    # the same plugin on one process: nothing crosses a boundary, all pass
    run_suite(pytester, *plant, *TINY_LLAMA).assert_outcomes(passed=18)


#: A planted RMSNorm kernel (an epsilon of 1e-2 where tiny-llama's is 1e-6), loaded with
#: --candidates on every rank.
WRONG_NORM = """
import numalign
from operators.norms import rms_norm_reference


@numalign.candidate("rms_norm", name="wrong_eps")
def wrong_eps(x, weight, eps, offset=0.0):
    return rms_norm_reference(x, weight, 1e-2, offset)
"""


@pytest.mark.usefixtures("on_path")
def test_a_kernel_swapped_into_the_ranks_layers_is_caught_on_each_rank(
    pytester: pytest.Pytester,
) -> None:
    """--pp with --swap: each rank's norms are swapped in place (their weights load as the
    stage's do; replay.swap.Swapped), so the wrong kernel fails every norm replayed alone, on
    rank 0's layer and on rank 1's, and the whole model at rank 0's first norm."""
    pytester.makepyfile(wrong_norm=WRONG_NORM)
    result = run_suite(
        pytester, "--pp", "2", "--candidates", "wrong_norm", "--swap", "rms_norm=wrong_eps",
        "--dtype", "float32", "-k", "tiny-llama and not deep and (test_model or input_layernorm)",
    )  # fmt: skip
    out = result.stdout.str()
    assert failed_tests(result) == {
        "test_model[tiny-llama-float32]",
        "test_layer[tiny-llama/model.layers.0.input_layernorm-float32]",
        "test_layer[tiny-llama/model.layers.1.input_layernorm-float32]",
    }, out[-3000:]
    piped = records(pytester)
    assert {r.swap for r in piped} == {"rms_norm=wrong_eps,pp=0|1"}, out[-2000:]
    divergence = next(r.first_divergence for r in piped if r.first_divergence)
    assert (divergence["point"], divergence["kind"]) == ("model.layers.0.input_layernorm", "local")


@pytest.mark.usefixtures("on_path")
def test_more_ranks_than_layers_fail_with_the_numbers(pytester: pytest.Pytester) -> None:
    result = run_suite(
        pytester, "--pp", "3", "--dtype", "float32", "-k", "test_model and tiny-llama and not deep"
    )
    out = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "tiny-llama: 3 pipeline ranks for 2 decoder layers" in out, out[-2000:]
    (error,) = records(pytester)
    assert error.verdict == "error" and error.error == "PipelineUsageError"


def test_the_boundary_checksum_sees_any_change_of_the_bytes() -> None:
    torch = pytest.importorskip("torch")
    hidden = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(0))
    sent = int(digest(hidden))
    assert int(digest(hidden.clone())) == sent
    swapped = hidden.clone()
    swapped[0, 0, [0, 1]] = hidden[0, 0, [1, 0]]  # the same values, two places swapped
    rounded = hidden.to(torch.bfloat16).to(hidden.dtype)
    nudged = hidden.clone()
    nudged[1, 6, 63] = torch.nextafter(hidden[1, 6, 63], torch.tensor(math.inf))
    for changed in (swapped, rounded, nudged):
        assert int(digest(changed)) != sent
    # every dtype passes as bytes: the same values in bfloat16 have a checksum of their own
    assert int(digest(hidden.to(torch.bfloat16))) != sent


def test_a_stage_holds_its_own_layers_weights_and_no_others() -> None:
    torch = pytest.importorskip("torch")
    from numalign.golden.stream import load_streamed

    whole = load_streamed(MODELS / "tiny-deep-llama", "float32", "cpu")
    for unit in whole.numalign_streamer.units:
        whole.numalign_streamer.enter(unit)
    sizes = {n: p.numel() for n, p in whole.named_parameters()}
    for rank, first, last in ((0, 0, 7), (1, 8, 15), (2, 16, 23)):  # 24 layers on 3 ranks
        stage = load_stage(MODELS / "tiny-deep-llama", "float32", "cpu", rank=rank, ranks=3)
        held = {n for n, p in stage.named_parameters() if p.device.type != "meta"}
        layers = {int(n.split(".")[2]) for n in held if n.startswith("model.layers.")}
        assert layers == set(range(first, last + 1))
        assert ("model.embed_tokens.weight" in held) == (rank == 0)
        assert ("lm_head.weight" in held) == (rank == 2)
        assert ("model.norm.weight" in held) == (rank == 2)
        # every parameter of the stage's layers is held, nothing else
        expected = {n for n in sizes if n.startswith(tuple(f"model.layers.{i}." for i in layers))}
        assert held - {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} == (
            expected
        )
        # and they are the checkpoint's own values
        got = dict(stage.named_parameters())
        assert all(torch.equal(got[n], whole.get_parameter(n)) for n in held)


def test_layers_split_contiguously_and_as_evenly_as_they_divide() -> None:
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    # the depth % ranks layers over go to the ranks before the last, from the last but one
    # back, as vLLM's get_pp_indices places them (vllm/distributed/utils.py)
    assert split_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert layout(24, 3) == "0-7|8-15|16-23"
    assert layout(4, 3) == "0|1-2|3"
    assert layout(7, 4) == "0-1|2-3|4-5|6"
    assert layout(3, 2) == "0-1|2"
    with pytest.raises(PipelineUsageError, match="choose a --pp of at most 2"):
        split_layers(2, 3)


def test_what_cannot_be_split_is_refused_from_the_config() -> None:
    with pytest.raises(PipelineUnsupported, match="BertModel is not one"):
        check_pipelinable(MODELS / "tiny-bert", 2)
    with pytest.raises(PipelineUnsupported, match="Qwen2VLForConditionalGeneration"):
        check_pipelinable(MODELS / "tiny-qwen2-vl", 2)
    with pytest.raises(PipelineUsageError, match="tiny-llama: 3 pipeline ranks"):
        check_pipelinable(MODELS / "tiny-llama", 3)
    check_pipelinable(MODELS / "tiny-deep-llama", 24)  # one layer a rank: allowed


def test_options_pipeline_ranks_do_not_combine_with_are_named() -> None:
    assert pipeline_conflicts(Settings(pp=2)) is None
    assert pipeline_conflicts(Settings(tp=2)) is None  # --pp off
    assert pipeline_conflicts(Settings(pp=2, swaps=("rms_norm=fused",))) is None  # in place
    assert pipeline_conflicts(Settings(pp=2, compile_backend="inductor")) is None  # by unit
    conflict = pipeline_conflicts(Settings(pp=2, tp=2, compile_backend="inductor"))
    assert conflict is not None
    assert re.search(r"--pp is not supported together with --tp yet", conflict)
    assert "drop --pp, or drop --tp" in conflict
