"""A kernel swap in a streamed model (``--stream --swap``): the swap replaces each module's
forward in place (``replay.swap.Swapped``), so the module keeps the parameters the streamed
load reads by name; the records of a streamed swap are the unstreamed swap's, bit for bit, a
wrong kernel swapped in is caught at the same module, the adapter's probe check runs at the
module's first call (its weights are on the meta device until then), and no weight stays on
the device between calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from numalign.golden.stream import load_streamed
from numalign.replay.engines.transformers import TransformersEngine
from numalign.replay.swap import apply_swaps, swapped_as
from numalign.replay.verdict import records
from numalign.session.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
LLAMA_SET = ROOT / "golden" / "sets" / "tiny-llama"
LLAMA = ROOT / "golden" / "models" / "tiny-llama"
CPU = torch.device("cpu")


def _fields(rs: list[Any]) -> list[tuple[Any, ...]]:
    """Every record's identity, verdict, metrics (bitwise), budget and first divergence."""
    return [
        (r.key, r.verdict, r.rule, r.metrics, r.budget, r.budget_used, r.first_divergence)
        for r in rs
    ]


def _both(swap: str) -> tuple[list[Any], list[Any]]:
    """The whole-model replay of tiny-llama in float32 with ``swap``, unstreamed and
    streamed: each one's records."""
    got = []
    for stream in (False, True):
        engine = TransformersEngine(Settings(dtypes=("float32",), swaps=(swap,), stream=stream))
        try:
            replayed = engine.model(LLAMA_SET, "float32", CPU, None)
            got.append(records(replayed.verdict, "t", **replayed.context))
            if stream:
                for model in engine.cache.models.values():
                    assert model.numalign_streamer.resident() == []  # nothing held between
        finally:
            engine.close()
    return got[0], got[1]


def test_a_streamed_swap_gives_the_unstreamed_swaps_records() -> None:
    plain, streamed = _both("rms_norm=fused")
    assert _fields(streamed) == _fields(plain)
    assert all(r.verdict == "passed" for r in plain), [r.point for r in plain if r.verdict]
    assert {r.swap for r in streamed} == {"rms_norm=fused,stream"}


def test_a_wrong_kernel_swapped_into_a_streamed_model_is_caught_at_the_same_module(
    wrong_kernel: str,
) -> None:
    plain, streamed = _both(wrong_kernel)
    assert _fields(streamed) == _fields(plain)
    divergence = next(r.first_divergence for r in streamed if r.first_divergence)
    assert divergence["point"] == "model.layers.0.input_layernorm", divergence
    assert divergence["kind"] == "local"


def test_the_adapter_is_checked_at_the_first_call_of_a_streamed_module() -> None:
    model = load_streamed(LLAMA, "float32", CPU)
    swapped = apply_swaps(model, [("rms_norm", "fused")])
    norm = model.get_submodule("model.layers.0.input_layernorm")
    found = swapped_as(norm)
    assert "model.layers.0.input_layernorm" in swapped and found is not None
    # the module, its type and its parameters' names stay: what the streamed load reads by
    assert type(norm).__name__ == "LlamaRMSNorm" and norm.weight.device.type == "meta"
    assert found.usable is None  # its weights were not there when it was swapped
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert found.usable  # settled at its first call, on its weights
