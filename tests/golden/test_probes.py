"""Probes (``golden.probes``): each norm is also fed rows whose variance is its epsilon, and
each kind of activation its gating tail, recorded as calls of the point under the request
``probe``, which is no request of the set; a capture with ``probes=False`` has none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from numalign.golden import GoldenSet
from numalign.golden.capture import capture
from numalign.golden.capture_spec import CaptureSpec
from numalign.golden.manifest import PROBE_REQUEST
from numalign.golden.probes import (
    ACTIVATION_GRID,
    ACTIVATION_TAIL,
    MIN_VARIANCE,
    NORM_ROWS,
    norm_epsilon,
    norm_probe,
)

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "golden" / "models"
SETS = ROOT / "golden" / "sets"


def test_the_zoo_sets_probe_every_norm_at_its_epsilon_and_the_activation() -> None:
    golden = GoldenSet.open(SETS / "tiny-llama")
    assert PROBE_REQUEST not in {r.name for r in golden.requests}
    assert golden.request(PROBE_REQUEST).inputs == {}  # no model inputs, no mask
    probed = {p.name: p.calls[PROBE_REQUEST] for p in golden.points if PROBE_REQUEST in p.calls}
    assert set(probed) == {"model.layers.0.input_layernorm",
                           "model.layers.0.post_attention_layernorm",
                           "model.layers.1.input_layernorm",
                           "model.layers.1.post_attention_layernorm", "model.norm",
                           "model.layers.0.mlp.act_fn"}  # fmt: skip
    for name, (call,) in probed.items():
        x = golden.tensor(call.args[0])
        if name.endswith("act_fn"):
            assert x.numel() == ACTIVATION_GRID
            assert (x.min().item(), x.max().item()) == pytest.approx(ACTIVATION_TAIL)
            continue
        # tiny-llama's rms_norm_eps is 1e-6: every row's variance is it (float32 rounding)
        variance = x.double().var(dim=-1, unbiased=False)
        assert x.shape == (1, NORM_ROWS, 64)
        assert torch.allclose(variance, torch.full_like(variance, 1e-6), rtol=1e-5)
    # the activation point has the probe's call only: no request calls it as a point
    act = golden.point("model.layers.0.mlp.act_fn")
    assert set(act.calls) == {PROBE_REQUEST}


def test_a_capture_without_probes_has_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = CaptureSpec(probes=False, progress=False, decode_steps=0, long=0, far=0,
                       continuation=0)  # fmt: skip
    golden = capture(ZOO / "tiny-llama", tmp_path / "set", spec)
    assert not [p.name for p in golden.points if PROBE_REQUEST in p.calls]
    assert "model.layers.0.mlp.act_fn" not in {p.name for p in golden.points}


def test_a_norms_epsilon_is_read_from_its_attribute() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert norm_epsilon(LlamaRMSNorm(8, eps=1e-6)) == 1e-6
    assert norm_epsilon(torch.nn.LayerNorm(8, eps=1e-5)) == 1e-5
    assert norm_epsilon(torch.nn.Linear(8, 8)) is None  # not a norm


def test_an_epsilon_too_small_for_float16_is_probed_at_the_floor() -> None:
    # BERT's 1e-12: rows of that variance hold values of 1e-6, below float16's normal numbers
    x = norm_probe(torch.nn.LayerNorm(16, eps=1e-12), torch.float32, tensors=1)
    variance = x.double().var(dim=-1, unbiased=False)
    assert torch.allclose(variance, torch.full_like(variance, MIN_VARIANCE), rtol=1e-5)


def test_a_norm_that_takes_more_than_its_hidden_states_has_no_probe() -> None:
    # a gated norm (hidden states and a gate): the probe feeds one tensor only
    assert norm_probe(torch.nn.LayerNorm(16), torch.float32, tensors=2) is None
