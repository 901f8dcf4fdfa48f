"""The vLLM engine on the zoo: honest vLLM passes, and bugs planted into vLLM's layers in the
engine's process each fail at their own module and step.

Runs where vLLM is installed (CI's vLLM environment, see .ci/run and docs/vllm.md); elsewhere
it skips with that reason. One engine per set and dtype serves every test here.
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

from numalign.replay.engines.vllm import VllmEngine
from numalign.session.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
MISTRAL = ROOT / "golden" / "sets" / "tiny-mistral"
LAYER = "model.layers.1"


def _model(engine: VllmEngine, dtype: str) -> Any:
    engine._served.clear()  # a fresh serving: the plant changes what the engine computes
    return engine.model(MISTRAL, dtype, torch.device("cpu"), None).verdict


def _decode(engine: VllmEngine, dtype: str) -> Any:
    return engine.decode(MISTRAL, dtype, "paged", torch.device("cpu"), None).verdict


@contextmanager
def _hooked(module: torch.nn.Module, hook: Callable[..., Any], pre: bool = False) -> Iterator[None]:
    handle = module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _running_model(engine: VllmEngine, dtype: str) -> Any:
    from numalign.replay.sets import open_fresh

    return engine._engine(open_fresh(MISTRAL), dtype).model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_honest_vllm_passes(engine: VllmEngine, dtype: str) -> None:
    model = _model(engine, dtype)
    decode = _decode(engine, dtype)
    assert model.passed, model.message("tiny-mistral")
    assert decode.passed, decode.message("tiny-mistral")
    # every block numalign captures is mapped (only eager's attention weights, the
    # model-level rotary embedding, which vLLM applies inside each attention, the masks,
    # which vLLM never builds, and the activation's probe point, which vLLM fuses with the
    # up projection, have no counterpart; the far request's explicit positions are not
    # served), the residual stream of every fused add + norm is judged, and the decode
    # judged every step's points and logits
    assert set(model.unmapped) <= {f"{LAYER}.self_attn.1", "model.layers.0.self_attn.1",
                                   "model.rotary_emb", "model.layers.0.mlp.act_fn",
                                   "model.create_causal_mask",
                                   "model.create_sliding_window_causal_mask",
                                   "request far-positions"}  # fmt: skip
    assert any(r.path == "residual" for r in model.points)
    assert {r.step for r in decode.points} == {1, 2, 3, 4}
    assert len(decode.logits) == 2 * 4  # two decode requests, four steps each


# float32 only: in bfloat16 a 1% scale (five bfloat16 roundings) stays inside the model
# points' per-element budgets (systematic errors below bfloat16's noise: issue 25)
@pytest.mark.parametrize("dtype", ["float32"])
def test_rms_norm_one_percent_too_large(engine: VllmEngine, dtype: str) -> None:
    norm = _running_model(engine, dtype).get_submodule(f"{LAYER}.post_attention_layernorm")

    def larger(module: Any, args: Any, out: Any) -> Any:
        if isinstance(out, tuple):
            return (out[0] * 1.01, *out[1:])
        return out * 1.01

    with _hooked(norm, larger):
        verdict = _model(engine, dtype)
        decode = _decode(engine, dtype)
    assert verdict.divergence is not None
    assert (verdict.divergence.point, verdict.divergence.kind) == (
        f"{LAYER}.post_attention_layernorm", "local",
    )  # fmt: skip
    assert decode.divergence is not None
    assert (decode.divergence.step, decode.divergence.point) == (
        1, f"{LAYER}.post_attention_layernorm",
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_add_norm_returning_the_pre_add_residual(engine: VllmEngine, dtype: str) -> None:
    norm = _running_model(engine, dtype).get_submodule(f"{LAYER}.input_layernorm")

    def stale(module: Any, args: Any, out: Any) -> Any:
        if isinstance(out, tuple) and len(args) == 2:
            return (out[0], args[1].clone())  # the residual before the add
        return out

    with _hooked(norm, stale):
        verdict = _model(engine, dtype)
    assert verdict.divergence is not None
    # the normed output is right; the stream beside it is not, and alone it fails too
    assert (verdict.divergence.point, verdict.divergence.kind) == (
        f"{LAYER}.input_layernorm", "local",
    )  # fmt: skip
    assert "residual" in verdict.divergence.result.name


def test_rotary_at_the_wrong_position_for_decode_tokens(engine: VllmEngine) -> None:
    dtype = "float32"
    model = _running_model(engine, dtype)
    rotary = model.get_submodule("model.layers.0.self_attn.rotary_emb")

    def shifted(module: Any, args: Any) -> Any:
        from vllm.forward_context import get_forward_context

        metadata = next(iter(get_forward_context().attn_metadata.values()))
        starts = metadata.query_start_loc.tolist()
        runner = engine._running.runner  # type: ignore[union-attr]
        prompts = [len(runner.requests[r].prompt_token_ids) for r in runner.input_batch.req_ids]
        positions = args[0].clone()
        for (begin, end), prompt in zip(itertools.pairwise(starts), prompts, strict=False):
            if end - begin == 1 and int(positions[begin]) >= prompt:  # a decode step's token
                positions[begin] += 1
        return (positions, *args[1:])

    with _hooked(rotary, shifted, pre=True):
        verdict = _model(engine, dtype)
        decode = _decode(engine, dtype)
    # prompt positions keep theirs (a chunk of one prompt token too): the prompts pass
    assert verdict.passed, verdict.message("tiny-mistral")
    assert decode.divergence is not None
    # the shared rotary of every layer: layer 0's attention is the first it reaches
    assert (decode.divergence.step, decode.divergence.point) == (1, "model.layers.0.self_attn")


def test_kv_cache_write_one_slot_late(engine: VllmEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    dtype = "float32"
    # the engine first: its start imports vLLM's attention backends (a first import of them
    # here, in a worker that has started no engine yet, meets torch's deprecation warnings)
    _running_model(engine, dtype)
    from vllm.v1.attention.backends import cpu_attn

    write = cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update

    def late(self: Any, layer: Any, key: Any, value: Any, cache: Any, slots: Any) -> None:
        write(self, layer, key, value, cache, slots + 1)

    monkeypatch.setattr(cpu_attn.CPUAttentionBackendImpl, "do_kv_cache_update", late)
    verdict = _model(engine, dtype)
    monkeypatch.undo()
    assert verdict.divergence is not None
    assert verdict.divergence.point == "model.layers.0.self_attn"
    engine._served.clear()  # what the late cache served is not kept for other tests


def test_an_engine_that_outlives_its_timeout_is_crashed_and_stopped(
    engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from numalign.replay.engines import vllm_serving as module
    from numalign.replay.engines.errors import EngineError

    _running_model(engine, "float32")
    engine._served.clear()
    monkeypatch.setattr(module, "SERVE_TIMEOUT_S", 0.0)  # every serving is past its deadline
    with pytest.raises(EngineError, match="hung or is far too slow") as raised:
        engine.model(MISTRAL, "float32", torch.device("cpu"), None)
    assert raised.value.crashed
    assert engine._running is None  # stopped: the next test starts a fresh engine
    monkeypatch.undo()
    assert engine.model(MISTRAL, "float32", torch.device("cpu"), None).verdict.passed


def test_an_engine_that_fails_to_start_is_an_error_naming_the_set(
    engine: VllmEngine, tmp_path: Path
) -> None:
    import shutil
    from types import SimpleNamespace

    from numalign.replay.engines.errors import EngineError
    from numalign.replay.sets import open_fresh
    from numalign.runtime.serving import ARRANGEMENTS, DEFAULT_SERVING

    golden = open_fresh(MISTRAL)
    broken = tmp_path / "tiny-mistral"
    shutil.copytree(golden.model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a truncated checkpoint
    fake = SimpleNamespace(
        model_dir=broken, name="broken-mistral", path=tmp_path, requests=[],
        decode_requests=[], points=golden.points,
    )  # fmt: skip
    engine._stop()  # one engine at a time in a process
    with pytest.raises(EngineError, match="vLLM failed to start for broken-mistral"):
        engine._start(fake, "float32", ARRANGEMENTS[DEFAULT_SERVING])  # type: ignore[arg-type]
    # the failed start left nothing behind: the next engine starts and serves
    assert engine.model(MISTRAL, "float32", torch.device("cpu"), None).verdict.passed


def test_the_compiled_graph_is_judged_by_its_logits(engine: VllmEngine) -> None:
    """--compile serves vLLM's default compiled graph: module hooks do not reach inside it,
    so every point but the head is unmapped with that reason, and the engine's logits (and
    the lm_head point) are judged; a point's layer replay is not judged, and says why."""
    from numalign.replay.engines import NotJudged

    engine._stop()  # one engine at a time in a process
    compiled = VllmEngine(Settings(engine="vllm", compile_backend="inductor"))
    try:
        replayed = compiled.model(MISTRAL, "float32", torch.device("cpu"), None)
        with pytest.raises(NotJudged, match="compiled graph") as not_judged:
            compiled.layer(MISTRAL, "model.norm", "float32", torch.device("cpu"), None)
    finally:
        compiled.close()
    verdict = replayed.verdict
    assert verdict.passed, verdict.message("tiny-mistral")
    assert {r.point for r in verdict.points} == {"lm_head"}
    assert len(verdict.logits) == 4 and all(lg.values is not None for lg in verdict.logits)
    assert "compiled graph" in verdict.unmapped["model.norm"]
    assert "vllm-graph=compiled" in replayed.context["swap"]
    # the skip's record carries the replay's fields (the reports count it per model and dtype)
    assert not_judged.value.record_fields()["model"] == "tiny-mistral"


def test_memory_the_machine_lacks_is_an_error_saying_what_to_lower(
    engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from numalign.replay.engines import vllm_options as module
    from numalign.replay.engines.errors import EngineError

    engine._stop()  # one engine at a time in a process
    monkeypatch.setattr(
        module, "_kv_cache_bytes", lambda golden, dtype, copies=1: 1 << 50
    )  # a petabyte
    with pytest.raises(EngineError, match="could not reserve memory for tiny-mistral") as raised:
        engine.model(MISTRAL, "float32", torch.device("cpu"), None)
    assert "fewer xdist workers" in str(raised.value) and not raised.value.crashed
    monkeypatch.undo()
    assert engine.model(MISTRAL, "float32", torch.device("cpu"), None).verdict.passed


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(), reason="the CPU has no AMX: nothing to ask for"
)
def test_vllm_runs_with_onednn_and_aten_capped_below_amx(tmp_path: Path) -> None:
    """vLLM's attention picks its AMX kernel from the hardware; with oneDNN capped below AMX
    or ATen capped to AVX2 nobody asked Linux for the AMX state and the process died of an
    illegal instruction. The engine asks for it: the replay runs and passes (in a process of
    its own: the caps are read once)."""
    import os
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from numalign.replay.engines.vllm import VllmEngine\n"
        "from numalign.session.settings import Settings\n"
        "engine = VllmEngine(Settings(engine='vllm'))\n"
        f"verdict = engine.model({str(MISTRAL)!r}, 'bfloat16', torch.device('cpu'), None).verdict\n"
        "engine.close()\n"
        "print('passed' if verdict.passed else 'failed')\n"
    )
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16", ATEN_CPU_CAPABILITY="avx2")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=tmp_path, check=False, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "passed", done.stdout[-2000:]


def test_bfloat16_with_onednn_capped_below_its_gemms_is_unsupported_not_an_abort(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from numalign.replay.engines.errors import EngineUnsupported

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    engine = VllmEngine(Settings(engine="vllm"))
    try:
        with pytest.raises(EngineUnsupported, match="ONEDNN_MAX_CPU_ISA=AVX2 caps oneDNN below"):
            engine.model(MISTRAL, "bfloat16", torch.device("cpu"), None)
        assert engine._running is None  # refused before vLLM started anything
    finally:
        engine.close()
