"""A module a model keeps in float32 in a low-precision run (``_keep_in_fp32_modules``:
HY-V4's LM head, router and indexer projections) is replayed alone in its own dtype, as the
model feeds it: fed the bfloat16 of the run, its float32 weights met bfloat16 inputs and the
isolated calibration of every swept HY-V4 crashed (``expected m1 and m2 to have the same
dtype``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from numalign.golden.capture import capture
from numalign.golden.capture_spec import CaptureSpec
from numalign.replay.layer import fed_dtypes, input_dtype, replay_call
from numalign.sweep.build import build_tiny


def test_the_input_dtype_is_the_one_dtype_a_module_keeps() -> None:
    kept = torch.nn.Linear(4, 4)  # float32 parameters in a bfloat16 run
    assert input_dtype(kept, torch.bfloat16) == torch.float32
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).bfloat16())
    assert input_dtype(mixed, torch.bfloat16) == torch.bfloat16  # the run's: no one dtype
    assert input_dtype(torch.nn.GELU(), torch.float16) == torch.float16  # no parameters


class CastsItsInput(torch.nn.Module):
    """DeepSeek-V3's router on transformers 5.24: a float32 weight, and the input cast to
    float32 inside, so that the model feeds it the hidden states in the run's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.fed = hidden.dtype
        return torch.nn.functional.linear(hidden.float(), self.weight)


def test_a_module_kept_in_float32_is_fed_the_runs_dtype_where_it_takes_it() -> None:
    router = CastsItsInput()
    assert fed_dtypes(router, torch.bfloat16) == [torch.bfloat16, torch.float32]
    assert fed_dtypes(torch.nn.Linear(4, 4).bfloat16(), torch.bfloat16) == [torch.bfloat16]
    # the model feeds it bfloat16 in a bfloat16 run: alone it is fed so too (fed float32, its
    # isolated budget would be float32's, which another honest router in bfloat16 exceeds)
    hidden = torch.randn(3, 8)  # the one golden input, under the key "h"
    golden = SimpleNamespace(tensor=lambda key, device=None: hidden)
    call = SimpleNamespace(args=("h",), args_json=(None,), kwargs={}, kwargs_json={})
    replay_call(router, golden, call, device="cpu", dtype=torch.bfloat16)
    assert router.fed == torch.bfloat16


def test_a_module_kept_in_float32_replays_alone_in_a_bfloat16_model(tmp_path: Path) -> None:
    model_dir = build_tiny("hy_v4", tmp_path / "models")
    spec = CaptureSpec(continuation=0, decode_steps=0, long=0, far=0, progress=False)
    golden = capture(model_dir, tmp_path / "sets" / "hy_v4", spec)
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
