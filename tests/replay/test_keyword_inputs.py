"""A capture point's keyword inputs are recorded in their own shape and fed back in it: a dict
(Zaya's masks by kind, DeepSeek-V4's rotary tables by layer type) stays a dict, a tuple a
tuple, a None inside one a None. Before, every nested input was flattened to a list and fed
back as a tuple, and those models' modules crashed alone (``mask_mapping.get``,
``position_embeddings["main"]``) in the sweep's isolated calibration. Positional inputs are
recorded so too: Qwen4-Exp's attention takes its rotary tables as a positional tuple, which
was kept as an object and fed back as None (``cannot unpack non-iterable NoneType``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from numalign.golden.capture import capture
from numalign.golden.capture_spec import CaptureSpec
from numalign.golden.recorder import key_tree
from numalign.replay.layer import call_inputs, replay_call
from numalign.sweep.build import build_tiny

#: the capture these tests read: the prompts' forward alone
FORWARD_ONLY = CaptureSpec(continuation=0, decode_steps=0, long=0, far=0, progress=False)


def _assert_replays_as_captured(model_dir: Path, golden: Any, point: str, call: Any) -> None:
    """The point's module, from the checkpoint in float32, fed the call's golden inputs,
    gives the golden outputs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()  # fmt: skip
    outputs = replay_call(model.get_submodule(point), golden, call, device="cpu",
                          dtype=torch.float32)  # fmt: skip
    assert set(outputs) == set(call.outputs)
    for path, key in call.outputs.items():
        expected = golden.tensor(key)
        finite = expected.isfinite()  # a left-padded row's fully masked positions may be NaN
        # the same module, inputs, dtype and machine as the capture: the golden output to
        # float32 reordering (1e-4 absolute on hidden states of order ten; a mask or rotary
        # table fed wrongly, or not at all, differs by the values themselves)
        assert (outputs[path][finite] - expected[finite]).abs().max() < 1e-4


def test_a_nested_keyword_input_keeps_its_shape() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    stored: dict[str, torch.Tensor] = {}

    def put(path: str, t: torch.Tensor) -> str:
        stored[f"k/{path}"] = t
        return f"k/{path}"

    assert key_tree(a, put) == "k/0"  # a plain tensor: its key, as sets always held
    assert key_tree((a, b), put) == ["k/0", "k/1"]  # a tuple: a list of keys, as before
    tree = key_tree({"main": (a, b), "compress": None, "conv": c}, put)
    assert tree == {"main": ["k/main.0", "k/main.1"], "compress": None, "conv": "k/conv"}
    # nothing to store, or something that is not a tensor beside them: kept as JSON instead
    assert key_tree(None, put) is None and key_tree((a, "text"), put) is None


@pytest.mark.parametrize(
    ("model_type", "keyword", "keys"),
    [
        ("zaya", "attention_mask", {"causal", "conv"}),  # its masks by kind
        ("deepseek_v4", "position_embeddings", {"main", "compress"}),  # rotary by layer type
    ],
)
def test_a_layer_fed_a_dict_replays_alone(
    tmp_path: Path, model_type: str, keyword: str, keys: set[str]
) -> None:
    model_dir = build_tiny(model_type, tmp_path / "models")
    golden = capture(model_dir, tmp_path / "sets" / model_type, FORWARD_ONLY)
    point = next(p for p in golden.points if p.name == "model.layers.0")
    call = next(iter(point.calls.values()))[0]
    recorded = call.kwargs[keyword]
    assert isinstance(recorded, dict) and set(recorded) == keys
    _, kwargs = call_inputs(golden, call, device="cpu", dtype=torch.float32)
    assert isinstance(kwargs[keyword], dict) and set(kwargs[keyword]) == keys

    _assert_replays_as_captured(model_dir, golden, point.name, call)


def test_a_layer_fed_a_positional_tuple_replays_alone(tmp_path: Path) -> None:
    model_dir = build_tiny("qwen4_exp", tmp_path / "models")
    golden = capture(model_dir, tmp_path / "sets" / "qwen4_exp", FORWARD_ONLY)
    # its decoder layer calls self_attn(hidden_states, position_embeddings, ...): cos and sin
    point = next(p for p in golden.points if p.name.endswith(".self_attn"))
    call = next(iter(point.calls.values()))[0]
    hidden, rotary = call.args[:2]
    assert isinstance(hidden, str)  # a plain tensor keeps the key sets always had
    assert isinstance(rotary, list) and len(rotary) == 2 and call.args_json[1] is None
    args, _ = call_inputs(golden, call, device="cpu", dtype=torch.float32)
    assert isinstance(args[1], tuple) and all(isinstance(t, torch.Tensor) for t in args[1])

    _assert_replays_as_captured(model_dir, golden, point.name, call)
