"""A module a model keeps in float32 in a low-precision run (``_keep_in_fp32_modules``:
HY-V4's LM head, router and indexer projections) is replayed alone in its own dtype, as the
model feeds it: fed the bfloat16 of the run, its float32 weights met bfloat16 inputs and the
isolated calibration of every swept HY-V4 crashed (``expected m1 and m2 to have the same
dtype``)."""

from __future__ import annotations

from pathlib import Path

import torch

from numalign.golden.capture import capture
from numalign.replay.layer import input_dtype, replay_call
from numalign.sweep.build import build_tiny


def test_the_input_dtype_is_the_one_dtype_a_module_keeps() -> None:
    kept = torch.nn.Linear(4, 4)  # float32 parameters in a bfloat16 run
    assert input_dtype(kept, torch.bfloat16) == torch.float32
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).bfloat16())
    assert input_dtype(mixed, torch.bfloat16) == torch.bfloat16  # the run's: no one dtype
    assert input_dtype(torch.nn.GELU(), torch.float16) == torch.float16  # no parameters


def test_a_module_kept_in_float32_replays_alone_in_a_bfloat16_model(tmp_path: Path) -> None:
    model_dir = build_tiny("hy_v4", tmp_path / "models")
    golden = capture(model_dir, tmp_path / "sets" / "hy_v4", continuation=0,
                     decode_steps=0, long=0, far=0, progress=False)  # fmt: skip
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    head = model.get_submodule("lm_head")
    assert head.weight.dtype == torch.float32  # the model's own choice, not numalign's
    point = next(p for p in golden.points if p.name == "lm_head")
    call = next(iter(point.calls.values()))[0]
    outputs = replay_call(head, golden, call, device="cpu", dtype=torch.bfloat16)
    for path, key in call.outputs.items():
        expected = golden.tensor(key)
        # float32 weights and inputs, as in the capture: the golden logits to float32
        # reordering (1e-4 absolute on logits of order one; bfloat16 inputs would differ by
        # their rounding, about 1e-2 here)
        assert outputs[path].dtype == torch.float32
        assert (outputs[path] - expected).abs().max() < 1e-4
