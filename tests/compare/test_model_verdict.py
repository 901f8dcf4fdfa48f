"""One ``Divergence`` for the whole model and for decode: each kind's record fields and
message as the model suites pin them, and the decode verdict names the first failing step."""

from __future__ import annotations

import torch

from numalign.compare import CompareSpec, compare
from numalign.compare.decode_verdict import DecodeVerdict
from numalign.compare.model_verdict import DecodeLocation, Divergence, PointResult

FAILED = compare(torch.ones(4), torch.zeros(4), CompareSpec(name="model.layers.1"))


def test_a_model_divergence_names_its_kind_and_the_module_at_fault() -> None:
    divergence = Divergence("model.layers.1", "accumulated", "r0", FAILED, named="model.norm")
    assert divergence.to_dict() == {
        "point": "model.layers.1", "kind": "accumulated", "request": "r0", "named": "model.norm",
    }  # fmt: skip
    assert divergence.describe().startswith(
        "first divergence at model.layers.1 (accumulated: the point alone is within budget; "
        "the error comes with its hidden states from upstream, from model.norm, which fails "
        "alone), request r0:\n"
    )


def test_a_decode_divergence_names_its_step_and_where_it_lives() -> None:
    location = DecodeLocation("accumulated", "model.layers.0.mlp", "the MLP before it is not")
    divergence = Divergence("model.layers.1", "decode", "r0", FAILED, step=2, location=location)
    assert divergence.to_dict() == {
        "point": "model.layers.1", "step": 2, "request": "r0", "kind": "decode",
        "located": "accumulated", "named": "model.layers.0.mlp",
    }  # fmt: skip
    assert divergence.describe().startswith(
        "first divergence at decode step 2, model.layers.1, request r0 (accumulated: the MLP "
        "before it is not):\n"
    )
    pooled = Divergence("model.layers.1", "decode", "r0", FAILED, step=None)
    assert pooled.to_dict() == {"point": "model.layers.1", "step": None, "request": "r0",
                                "kind": "decode"}  # fmt: skip
    assert pooled.describe().startswith("first divergence at every decode step pooled, ")


def test_the_decode_verdict_takes_the_earliest_step_and_marks_its_record() -> None:
    passed = compare(torch.zeros(4), torch.zeros(4), CompareSpec(name="model.layers.0"))
    verdict = DecodeVerdict("dynamic", points=[
        PointResult("model.layers.0", 0, "r0", "0", passed, "decode", finished=0, step=1),
        PointResult("model.layers.1", 1, "r0", "0", FAILED, "decode", finished=1, step=2),
        PointResult("model.layers.1", 1, "r0", "0", FAILED, "decode", finished=2, step=1),
    ])  # fmt: skip
    divergence = verdict.divergence
    assert divergence is not None and (divergence.kind, divergence.step) == ("decode", 1)
    assert [verdict.is_divergent(r, divergence) for r in verdict.points] == [False, False, True]
    assert not verdict.passed
    assert verdict.message("tiny [bfloat16]").startswith(
        "tiny [bfloat16] [dynamic cache]: first divergence at decode step 1, model.layers.1"
    )
