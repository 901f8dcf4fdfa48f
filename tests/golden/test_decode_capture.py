"""The zoo's cached decodes (golden format 2): every generating request has its decode steps
and cache snapshots in the layout each cache layer keeps; the cached decode is the same
function as the full recomputation; long requests cross every length boundary of the model;
and format 1 sets still load, with no decode steps and a reason to skip."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from numalign.golden import GoldenSet
from numalign.golden.decode import DEFAULT_DECODE_STEPS, new_token_output
from numalign.golden.manifest import FORMAT
from numalign.golden.reference import load_model
from numalign.golden.requests import length_boundaries
from numalign.golden.zoo import ZOO
from numalign.replay.decode import DecodeUnavailable, require_decode_replayable
from numalign.replay.model import replay_model

ROOT = Path(__file__).resolve().parents[2]
SETS = ROOT / "golden" / "sets"
DECODERS = [m.name for m in ZOO if m.name != "tiny-bert"]


@pytest.fixture(scope="module", params=DECODERS)
def golden(request: pytest.FixtureRequest) -> GoldenSet:
    return GoldenSet.open(SETS / request.param)


def test_every_generating_request_has_its_decode_steps_and_cache(golden: GoldenSet) -> None:
    generating = {r.name for r in golden.requests if r.name.endswith("leftpad")}
    generating |= {"image", "far-positions"} & {r.name for r in golden.requests}
    assert set(golden.decode_requests) == generating
    assert golden.manifest.format == FORMAT
    for name in golden.decode_requests:
        decode = golden.decode(name)
        assert decode is not None and decode.cache == "dynamic"
        assert len(decode.steps) == DEFAULT_DECODE_STEPS
        ids = golden.tensor(golden.request(name).inputs["input_ids"])
        batch, length = ids.shape
        for step in decode.steps:
            assert golden.tensor(step.token).shape == (batch, 1)
            assert golden.tensor(step.logits).shape[0] == batch
            for calls in step.points.values():
                for outputs in calls:
                    for key in outputs.values():
                        assert new_token_output(golden.tensor(key), batch)
        model = load_model(golden.model_dir, "float32", attn_implementation="eager",
                           trust_remote_code=False)  # fmt: skip
        config = model.config.get_text_config(decoder=True)
        # a config without layer types (Mistral's) slides every layer when it has a window
        window = getattr(config, "sliding_window", None)
        uniform = "sliding_attention" if window else "full_attention"
        kinds = list(getattr(config, "layer_types", None) or [uniform] * 99)
        seen = length + DEFAULT_DECODE_STEPS  # the last step's token is in the cache
        for state, key in decode.final_cache.items():
            layer = int(state.split(".")[1])
            tensor = golden.tensor(key)
            if state.endswith((".keys", ".values")):
                # a dynamic sliding-window layer keeps window - 1 positions, a full one all
                held = config.sliding_window - 1 if kinds[layer] == "sliding_attention" else seen
                assert tensor.shape[-2] == min(held, seen), state
            else:
                assert kinds[layer] == "linear_attention", state


def test_the_cached_decode_is_the_full_recomputation(golden: GoldenSet) -> None:
    """The unpadded row's cached decode gives the tokens and logits of the continuation that
    re-runs the whole sequence each step (the same function, summed in another order)."""
    name = "text-leftpad"
    decode, continuation = golden.decode(name), golden.continuation(name)
    assert decode is not None and continuation is not None
    mask = golden.tensor(golden.request(name).inputs["attention_mask"])
    row = int(mask.sum(-1).argmax())  # the longest row has no padding: the same positions
    tokens = golden.tensor(continuation.tokens)[row]
    logits = golden.tensor(continuation.logits)[row]
    for number, step in enumerate(decode.steps[:-1], start=1):
        assert int(golden.tensor(step.token)[row]) == int(tokens[number - 1])
        cached = golden.tensor(step.logits)[row]
        # two float32 orders of one function: within 1e-4 of the largest logit (a few hundred
        # float32 roundings; a wrong position or a stale cache entry moves logits by 1e-2+)
        assert (cached - logits[number]).abs().max() <= 1e-4 * logits[number].abs().max()


def test_long_requests_cross_every_length_boundary(golden: GoldenSet) -> None:
    model = load_model(golden.model_dir, "float32", attn_implementation="eager",
                       trust_remote_code=False)  # fmt: skip
    boundaries = length_boundaries(model.config)
    assert "page" in boundaries
    for side in ("leftpad", "rightpad"):
        mask = golden.tensor(golden.request(f"long-{side}").inputs["attention_mask"])
        lengths = mask.sum(-1).tolist()
        assert lengths[0] != lengths[1]  # two rows, so padding matters
        for name, boundary in boundaries.items():
            assert max(lengths) > boundary, (name, boundary, lengths)
    assert golden.decode("long-leftpad") is not None


def test_the_boundaries_come_from_the_config() -> None:
    gemma = load_model(SETS.parent / "models" / "tiny-gemma2", "float32",
                       attn_implementation="eager", trust_remote_code=False)  # fmt: skip
    hybrid = load_model(SETS.parent / "models" / "tiny-qwen3-next", "float32",
                        attn_implementation="eager", trust_remote_code=False)  # fmt: skip
    assert length_boundaries(gemma.config)["sliding_window"] == 8  # the zoo's window
    assert length_boundaries(hybrid.config)["linear_attention_chunks"] == 3 * 64  # 3 chunks


def test_a_format_1_set_loads_replays_and_has_no_decode(tmp_path: Path) -> None:
    old = tmp_path / "old-llama"
    shutil.copytree(SETS / "tiny-llama", old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format"] = "numalign.golden/1"
    del manifest["decode"]
    manifest["model"]["path"] = str((SETS / "tiny-llama").resolve() / manifest["model"]["path"])
    (old / "manifest.json").write_text(json.dumps(manifest))
    golden = GoldenSet.open(old)
    assert golden.decode_requests == [] and golden.decode("text-leftpad") is None
    with pytest.raises(DecodeUnavailable, match=r"format 1 .* capture it again"):
        require_decode_replayable(golden, "bfloat16")
    model = load_model(golden.model_dir, "bfloat16", attn_implementation="eager",
                       trust_remote_code=False)  # fmt: skip
    assert replay_model(golden, model, "bfloat16", torch.device("cpu")).passed
    golden.write_calibration("bfloat16", golden.calibration("bfloat16"))  # stays format 1
    assert json.loads((old / "manifest.json").read_text())["format"] == "numalign.golden/1"
