"""The far-position request: rows at explicit positions a quarter, half and all the way into
the model's range, kept through the prefill, the decode steps and the greedy continuation;
refused by serving engines with the reason; long requests cross three linear-attention
chunks."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from numalign.golden.reference import append_token, decode_inputs, prefill_kwargs
from numalign.golden.requests import (
    POSITION_HEADROOM,
    far_request,
    far_starts,
    long_length,
    unservable,
)

ZOO = Path(__file__).resolve().parents[2] / "golden" / "models"


class _Model:
    """What decode_inputs reads of a model: its forward's cache argument, its modules."""

    def forward(self, input_ids: object = None, cache: object = None) -> None: ...

    def modules(self) -> list:
        return []


def test_far_rows_sit_a_quarter_half_and_all_the_way_into_the_range() -> None:
    config = AutoConfig.from_pretrained(ZOO / "tiny-llama")  # 256 positions
    assert far_starts(config, 8) == [64, 128, 256 - POSITION_HEADROOM - 8]
    assert far_starts(config, 8, limit=100) == [25, 50, 100 - POSITION_HEADROOM - 8]
    request = far_request(ZOO / "tiny-llama", config, 8, trust_remote_code=False)
    assert request is not None and request.generate
    positions = request.inputs["position_ids"]
    assert positions[:, 0].tolist() == [64, 128, 232] and positions.shape == (3, 8)
    assert torch.equal(positions[:, 1:] - positions[:, :-1], torch.ones(3, 7, dtype=torch.long))
    # the serving engines derive positions from the tokens: refused with the reason
    assert "explicit positions" in (unservable(request.inputs) or "")


def test_explicit_positions_go_on_through_prefill_decode_and_continuation() -> None:
    inputs = {"input_ids": torch.ones(1, 3, dtype=torch.long),
              "attention_mask": torch.ones(1, 3, dtype=torch.long),
              "position_ids": torch.tensor([[100, 101, 102]])}  # fmt: skip
    model = _Model()
    assert "position_ids" not in prefill_kwargs(model, inputs, cache=None)  # kept as given
    token = torch.tensor([[7]])
    grown, step = decode_inputs(model, inputs, token, cache=None)
    assert step["position_ids"].tolist() == [[103]]
    assert append_token(grown, token)["position_ids"].tolist() == [[100, 101, 102, 103, 104]]


def test_no_far_request_without_a_position_range_or_for_image_text_models() -> None:
    config = AutoConfig.from_pretrained(ZOO / "tiny-llama")
    config.max_position_embeddings = 20  # too short for a row beyond the start
    assert far_request(ZOO / "tiny-llama", config, 8, trust_remote_code=False) is None
    vl = AutoConfig.from_pretrained(ZOO / "tiny-qwen2-vl")
    assert far_request(ZOO / "tiny-qwen2-vl", vl, 8, trust_remote_code=False) is None


def test_a_long_request_crosses_three_linear_attention_chunks() -> None:
    hybrid = AutoConfig.from_pretrained(ZOO / "tiny-qwen3-next")
    assert long_length(hybrid) == 3 * 64 + 8  # past the third chunk's start, within 256
