"""Streamed replay (``--stream``, ``golden.stream``): the same records as an unstreamed
replay, for layer, full-model and decode replay, on a dense, an MoE (experts fused from
per-expert checkpoint tensors) and a tied-embedding model; only the unit running holds real
weights, and a layer replay reads only its unit's tensors; a checkpoint that lacks a
tensor, or has no safetensors, is a clear error; ``--stream`` with options it cannot serve
is a usage error."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from numalign.golden.reference import load_model
from numalign.golden.stream import StreamError, StreamUnsupported, load_streamed
from numalign.replay.engines.transformers import TransformersEngine
from numalign.replay.sets import open_fresh
from numalign.replay.verdict import point_record, records
from numalign.runtime.variant import Variant
from numalign.session.settings import Settings, stream_conflicts

ROOT = Path(__file__).resolve().parents[2]
SETS = ROOT / "golden" / "sets"
MODELS = ROOT / "golden" / "models"
CPU = torch.device("cpu")
#: A dense model and an MoE whose experts transformers fuses from per-expert tensors.
STREAMED_SETS = ["tiny-llama", "tiny-qwen3-moe"]
#: The decode replay's caches compared: a KV cache and the paged serving path.
CACHES = ["dynamic", "paged"]


def _fields(rs: list[Any]) -> list[tuple[Any, ...]]:
    """What must not change with streaming: every record's identity, verdict, metrics
    (bitwise: the same weights, the same code) and budget; the variant label aside."""
    return [
        (r.key, r.verdict, r.rule, r.metrics, r.budget, r.budget_used, r.first_divergence)
        for r in rs
    ]


@pytest.fixture(scope="module")
def engines() -> tuple[TransformersEngine, TransformersEngine]:
    plain = TransformersEngine(Settings(dtypes=("float32",)))
    streamed = TransformersEngine(Settings(dtypes=("float32",), stream=True))
    yield plain, streamed
    plain.close()
    streamed.close()


@pytest.mark.parametrize("name", STREAMED_SETS)
def test_streamed_layer_replay_gives_the_unstreamed_records(
    engines: tuple[TransformersEngine, TransformersEngine], name: str
) -> None:
    path = SETS / name
    for point in open_fresh(path).points:
        got = []
        for engine in engines:
            replayed = engine.layer(path, point.name, "float32", CPU, None)
            got.append([point_record(r, "t", **replayed.context) for r in replayed.verdict])
        assert _fields(got[1]) == _fields(got[0]), point.name
        assert got[1] and all((r.swap or "").endswith("stream") for r in got[1])


@pytest.mark.parametrize("name", STREAMED_SETS)
def test_streamed_model_and_decode_replays_give_the_unstreamed_records(
    engines: tuple[TransformersEngine, TransformersEngine], name: str
) -> None:
    path = SETS / name
    plain, streamed = (e.model(path, "float32", CPU, None) for e in engines)
    assert _fields(records(streamed.verdict, "t", **streamed.context)) == _fields(
        records(plain.verdict, "t", **plain.context)
    )
    for cache in CACHES:
        plain, streamed = (e.decode(path, "float32", cache, CPU, None) for e in engines)
        assert _fields(records(streamed.verdict, "t", **streamed.context)) == _fields(
            records(plain.verdict, "t", **plain.context)
        ), cache
    for model in engines[1].cache.models.values():
        assert model.numalign_streamer.resident() == []


def _tied_llama(folder: Path) -> Path:
    """The zoo's tiny Llama with its LM head tied to its embedding, random weights, saved
    in two shards (``model.safetensors.index.json``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((MODELS / "tiny-llama" / "config.json").read_text(encoding="utf-8"))
    config = {k: v for k, v in config.items() if k != "architectures"}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**(config | {"tie_word_embeddings": True})))
    # 100KB: below the model's ~0.3 MB of float32 weights, so the checkpoint has shards
    model.save_pretrained(folder, max_shard_size="100KB")
    return folder


def test_a_tied_sharded_checkpoint_streams_to_the_same_logits(tmp_path: Path) -> None:
    folder = _tied_llama(tmp_path / "tied")
    assert (folder / "model.safetensors.index.json").is_file()
    reference = load_model(folder, "float32", attn_implementation=None, trust_remote_code=False)
    model = load_streamed(folder, "float32", CPU)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        actual = model(input_ids=ids).logits
    assert torch.equal(actual, expected)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.numalign_streamer.resident() == []
    assert model.device == CPU


def test_a_streamed_model_holds_no_weights_between_calls_and_one_unit_at_most() -> None:
    model = load_streamed(MODELS / "tiny-llama", "float32", CPU)
    streamer = model.numalign_streamer
    assert streamer.resident() == [] and not streamer.reads
    ids = torch.arange(6)[None]
    with torch.no_grad():
        model(input_ids=ids)
    assert streamer.resident() == []
    assert streamer.loaded_bytes == 0
    # each forward reads every tensor once: the head is not tied here
    assert streamer.reads == dict.fromkeys(streamer.files, 1)
    units = {
        u: sum(model.get_parameter(n).numel() * 4 for n in ns) for u, ns in streamer.units.items()
    }
    assert streamer.peak_bytes == max(units.values())


@pytest.mark.parametrize(
    ("name", "point", "unit"),
    [
        ("tiny-llama", "model.layers.1.mlp", "model.layers.1."),
        ("tiny-qwen3-moe", "model.layers.0.mlp", "model.layers.0."),
    ],
)
def test_a_layer_replay_reads_only_the_tensors_of_its_unit(
    name: str, point: str, unit: str
) -> None:
    engine = TransformersEngine(Settings(dtypes=("float32",), stream=True))
    replayed = engine.layer(SETS / name, point, "float32", CPU, None)
    assert replayed.verdict and all(r.result.passed for r in replayed.verdict)
    (model,) = engine.cache.models.values()
    streamer = model.numalign_streamer
    tensors = {k for k in streamer.files if k.startswith(unit)}
    experts = {k for k in tensors if ".experts." in k}
    assert set(streamer.reads) <= tensors
    # each recorded call of the point reads its unit once, and only once; an MoE block's
    # experts only where the call routes to them (test_an_moe_layer_reads_only_...)
    calls = sum(len(c) for c in open_fresh(SETS / name).point(point).calls.values())
    assert {k: streamer.reads[k] for k in tensors - experts} == dict.fromkeys(
        tensors - experts, calls
    )
    assert all(streamer.reads[k] <= calls for k in experts)
    assert streamer.resident() == []


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v3"])
def test_an_moe_layer_reads_only_the_experts_routed_to(name: str) -> None:
    folder = MODELS / name
    reference = load_model(folder, "float32", attn_implementation=None, trust_remote_code=False)
    model = load_streamed(folder, "float32", CPU)
    streamer = model.numalign_streamer
    token = torch.tensor([[7]])
    with torch.no_grad():
        expected = reference(input_ids=token).logits
        actual = model(input_ids=token).logits
    assert torch.equal(actual, expected)
    # one token routes to top-k experts of each MoE layer: only theirs are read, each once
    top_k = reference.config.num_experts_per_tok
    read: dict[str, set[str]] = {}
    for key, count in streamer.reads.items():
        # by layer: the checkpoint may name the block otherwise (Mixtral's block_sparse_moe)
        match = re.search(r"layers\.(\d+)\..*\.experts\.(\d+)\.", key)
        if match:
            assert count == 1, key
            read.setdefault(match.group(1), set()).add(match.group(2))
    moe_layers = {n for n, m in reference.named_modules() if hasattr(m, "num_experts")
                  and isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)}  # fmt: skip
    assert set(read) == {re.search(r"layers\.(\d+)\.", n).group(1) for n in moe_layers}
    assert all(len(experts) == top_k for experts in read.values())
    assert streamer.resident() == [] and streamer.loaded_bytes == 0
    # the largest layer whole, every expert in it, is more than the stream ever held
    layers = [m for n, m in reference.named_modules() if re.fullmatch(r".*layers\.\d+", n)]
    largest = max(sum(p.nbytes for p in layer.parameters()) for layer in layers)
    assert 0 < streamer.peak_bytes < largest
    for layer in moe_layers:  # back to every expert, on meta, for the next call
        module = model.get_submodule(layer)
        assert module.num_experts == reference.get_submodule(layer).num_experts
        assert module.gate_up_proj.shape == reference.get_submodule(layer).gate_up_proj.shape


def test_a_checkpoint_missing_a_tensor_is_an_error_naming_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    shutil.copytree(MODELS / "tiny-llama", folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        StreamError, match=r"no tensor for model\.layers\.1\.mlp\.down_proj\.weight"
    ):
        load_streamed(folder, "float32", CPU)


def test_a_checkpoint_without_safetensors_cannot_stream(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(MODELS / "tiny-llama" / "config.json", folder / "config.json")
    with pytest.raises(StreamUnsupported, match=r"neither model\.safetensors nor"):
        load_streamed(folder, "float32", CPU)


def test_stream_with_an_option_it_cannot_serve_is_a_usage_error() -> None:
    # vLLM loads its own weights (checked on the settings: vLLM need not be installed)
    conflict = stream_conflicts(Settings(stream=True, engine="vllm"))
    assert conflict is not None and "together with --engine vllm" in conflict
    # tensor parallel streams each rank's shard (test_tensor_parallel_suite.py)
    assert stream_conflicts(Settings(stream=True, tp=2)) is None


def test_the_variant_names_streaming_only_when_set() -> None:
    assert Variant.from_settings(Settings(stream=True), cache="static").label == (
        "stream,cache=static"
    )
    fields = Variant.from_settings(Settings()).record_fields()
    assert fields["swap"] is None and "stream" not in fields
