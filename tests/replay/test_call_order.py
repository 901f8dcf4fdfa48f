"""A point called several times in a forward is matched call for call by the plain inputs
that tell its calls apart, not by the order they come in: Gemma 4 calls its rotary embedding
once per layer type in the order of ``set(config.layer_types)``, which Python's string
hashing orders anew in each process (``PYTHONHASHSEED``). A calibration member whose process
called "sliding_attention" first where the capture called "full_attention" first compared
each call with the other's golden output, and crashed in the sweep (``shape (1, 16, 16) !=
(1, 16, 32)``: the two layer types' head widths differ); where the widths agree (Gemma 3) it
measured the two tables' difference as the member's error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from numalign.golden.manifest import Call
from numalign.replay.layer import CallOrder

#: Seeds tried for a process that orders the layer types unlike this one (each seed orders two
#: names one way or the other, about half of them each way: 32 fail together by 2**-32).
SEEDS = range(32)


def _rotary_call(layer_type: str) -> Call:
    # as capture records Gemma 4's rotary_emb(hidden_states, position_ids, layer_type)
    return Call(("h", "p"), (None, None, layer_type), {}, {}, {"0": f"out/{layer_type}"})


def test_a_call_is_the_recorded_call_with_its_own_plain_inputs() -> None:
    recorded = [_rotary_call("full_attention"), _rotary_call("sliding_attention")]
    hidden, positions = torch.zeros(1, 2, 4), torch.arange(2)[None]
    order = CallOrder(recorded)
    # this process iterates the set the other way round: each call still finds its own
    assert order.index((hidden, positions, "sliding_attention"), {}) == 1
    assert order.index((hidden, positions, "full_attention"), {}) == 0
    assert order.index((hidden, positions, "full_attention"), {}) is None  # not recorded
    # a compiled model's taps carry no inputs: the calls go in order
    taps = CallOrder(recorded)
    assert [taps.index(None, None) for _ in range(3)] == [0, 1, None]


def test_calls_no_plain_input_tells_apart_go_in_order() -> None:
    # a module called twice on tensors alone (a shared norm), or with the same flags
    same = [Call(("h",), (None,), {}, {"flag": True}, {"0": f"out/{i}"}) for i in range(2)]
    order = CallOrder(same)
    assert [order.index((torch.zeros(1),), {"flag": True}) for _ in range(3)] == [0, 1, None]
    # a decode step's value no recorded call had (its own length) goes in order too
    lengths = [Call(("h",), (None, n), {}, {}, {"0": f"out/{n}"}) for n in (16, 17)]
    step = CallOrder(lengths)
    assert [step.index((torch.zeros(1), 1), {}) for _ in range(2)] == [0, 1]


def test_decode_steps_take_their_order_from_the_prefill_s_calls() -> None:
    prefill = [_rotary_call("full_attention"), _rotary_call("sliding_attention")]
    hidden, positions = torch.zeros(1, 1, 4), torch.arange(1)[None]
    order = CallOrder.for_steps(prefill, 2)
    assert order.index((hidden, positions, "sliding_attention"), {}) == 1
    # a step that called the point another number of times: in order
    other = CallOrder.for_steps(prefill, 3)
    got = [other.index((hidden, positions, "sliding_attention"), {}) for _ in range(3)]
    assert got == [0, 1, 2]


def _seed_ordering_otherwise(layer_types: list[str], first: str) -> int:
    """A PYTHONHASHSEED whose process iterates ``set(layer_types)`` from another type than
    ``first``, as Gemma 4's text model does."""
    script = f"print(next(iter(set({layer_types!r}))))"
    for seed in SEEDS:
        done = subprocess.run(
            [sys.executable, "-c", script], env=os.environ | {"PYTHONHASHSEED": str(seed)},
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        if done.stdout.strip() != first:
            return seed
    raise AssertionError(f"no seed of {SEEDS} orders {layer_types} from another type")


def test_a_member_whose_process_orders_the_layer_types_anew_calibrates(tmp_path: Path) -> None:
    from numalign.golden.capture_spec import CaptureSpec
    from numalign.replay.ensemble import Member, capture_calibrated
    from numalign.sweep.build import build_tiny

    model_dir = build_tiny("gemma4_text", tmp_path / "models")
    layer_types = json.loads((model_dir / "config.json").read_text())["layer_types"]
    # this process's order, as a capture here records it
    first = next(iter(set(layer_types)))
    seed = _seed_ordering_otherwise(layer_types, first)
    member = Member.parse(f"threads=1,PYTHONHASHSEED={seed},dtypes=float32")
    spec = CaptureSpec(continuation=0, decode_steps=1, long=0, far=0, progress=False)
    golden = capture_calibrated(
        model_dir, tmp_path / "set", spec, calibrate=("float32",), members=[member]
    )
    rotary = golden.point("model.rotary_emb")
    calls = rotary.calls["text-leftpad"]
    assert calls[0].args_json[2] == first != calls[1].args_json[2]
    # the two layer types' tables differ in width (Gemma 4's global head is wider): a member
    # that took one for the other could not compare them at all
    widths = {golden.tensor(c.outputs["0"]).shape[-1] for c in calls}
    assert len(widths) == 2
    for mode in ("isolated", "accumulated", "decode"):
        stats = golden.calibrated("float32", "model.rotary_emb", "0", mode)
        assert stats is not None, mode
        # the same float32 module on the same machine and positions computes the same cos
        # table (bit for bit here); the other layer type's table is off by order one
        assert (stats.max_abs or 0.0) < 1e-6, mode
