"""A decoder's left-padded requests are captured at the positions generation and the serving
engines give their tokens (each row's real tokens numbered from 0), so that a model with
learned absolute positions (GPT-2) has the same reference for a padded row as for the row
served alone; such requests are servable, other explicit positions are not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from numalign.golden.reference import forward_kwargs, generation_positions
from numalign.golden.requests import (
    CaptureRequest,
    far_request,
    text_requests,
    unservable,
    with_serving_positions,
)
from numalign.golden.store import GoldenSet

ROOT = Path(__file__).resolve().parents[2]
GPT2 = ROOT / "golden" / "models" / "tiny-gpt2"


@pytest.fixture(scope="module")
def gpt2() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(GPT2).eval()


def test_left_padded_requests_get_generation_positions_and_the_others_keep_theirs(
    gpt2: torch.nn.Module,
) -> None:
    left, right = text_requests(GPT2, gpt2.config, ("a b c d e f", "a b"), False)
    positioned = with_serving_positions(gpt2, left)
    mask = left.inputs["attention_mask"]
    assert bool((mask[:, 0] == 0).any())  # the short row is padded on the left
    assert torch.equal(positioned.inputs["position_ids"], generation_positions(mask))
    assert positioned.name == left.name and positioned.generate == left.generate
    # a right-padded row's real tokens already sit at 0, 1, ...: nothing to add
    assert with_serving_positions(gpt2, right) is right
    far = far_request(GPT2, gpt2.config, 8, trust_remote_code=False)
    assert far is not None and with_serving_positions(gpt2, far) is far  # its own positions


def test_a_model_that_takes_no_position_ids_is_left_as_it_is() -> None:
    class _Alibi(torch.nn.Module):  # BLOOM's forward: no position ids (ALiBi)
        config = AutoConfig.from_pretrained(GPT2)

        def forward(self, input_ids: object = None, attention_mask: object = None) -> None: ...

    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    request = CaptureRequest("text-leftpad", {"input_ids": mask, "attention_mask": mask})
    assert with_serving_positions(_Alibi(), request) is request


def test_generation_positions_are_servable_and_other_explicit_positions_are_not() -> None:
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    ids = torch.ones_like(mask)
    served = {"input_ids": ids, "attention_mask": mask, "position_ids": generation_positions(mask)}
    assert unservable(served) is None
    # padding's positions are not the engine's business: only the real tokens' are compared
    assert unservable({**served, "position_ids": torch.arange(4).expand(2, -1)}) is not None
    assert unservable({**served, "position_ids": generation_positions(mask) + 1}) is not None
    # a golden set's request names tensor keys: read through the set
    keys = {name: f"k/{name}" for name in served}
    values = {f"k/{name}": tensor for name, tensor in served.items()}
    assert unservable(keys, values.__getitem__) is None


def test_a_padded_rows_reference_is_the_row_served_alone(gpt2: torch.nn.Module) -> None:
    """The zoo's GPT-2 set: the left-padded row's golden logits are the logits of its tokens
    run unpadded (what a serving engine computes); run without the positions, the padded row
    differs by far more than rounding (the bug the positions fix)."""
    golden = GoldenSet.open(ROOT / "golden" / "sets" / "tiny-gpt2")
    request = golden.request("long-leftpad")
    inputs = {k: golden.tensor(v) for k, v in request.inputs.items()}
    mask = inputs["attention_mask"].bool()
    row = int((~mask[:, 0]).nonzero()[0])  # the padded row
    alone = inputs["input_ids"][row, mask[row]][None]
    with torch.no_grad():
        served = gpt2(input_ids=alone, **forward_kwargs(gpt2)).logits[0]
        padded_default = gpt2(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
            **forward_kwargs(gpt2),
        ).logits[row, mask[row]]  # fmt: skip
    golden_row = golden.tensor(golden.final_outputs("long-leftpad")["logits"])[row, mask[row]]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    # float32 of a batch of two against a batch of one: a few ulps of reordered sums
    assert rel(golden_row, served) < 1e-5
    # the positions shifted by the padding: a different input, not rounding (measured 1.08 on
    # the zoo's GPT-2, against 1.4e-8 above; a tenth is far above any float32 rounding)
    assert rel(padded_default, served) > 0.1
