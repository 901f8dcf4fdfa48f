"""The masks a model builds and what it does after its LM head, as capture points
(``golden.mask_points``, ``golden.logit_transform``): attached to the zoo's real models loaded
with ``from_pretrained``, routed per model, recorded by the capture and replayed alone."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from transformers import masking_utils
from transformers.models.llama import modeling_llama

from numalign.golden.logit_transform import LogitTransform
from numalign.golden.mask_points import MaskFunction, attach_mask_points
from numalign.golden.reference import load_model
from numalign.golden.store import GoldenSet

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "golden" / "models"
SETS = ROOT / "golden" / "sets"


def _load(name: str) -> torch.nn.Module:
    return load_model(MODELS / name, "float32", attn_implementation="eager",
                      trust_remote_code=False)  # fmt: skip


def test_each_model_s_mask_calls_go_through_its_own_point() -> None:
    first, second = _load("tiny-llama"), _load("tiny-llama")
    seen: list[str] = []
    for name, model in (("first", first), ("second", second)):
        point = model.get_submodule("model.create_causal_mask")
        assert isinstance(point, MaskFunction)
        point.register_forward_hook(lambda *a, name=name: seen.append(name))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        second(input_ids=ids)
        first(input_ids=ids)
    assert seen == ["second", "first"]
    # attaching again adds nothing; the point comes first among the model's children
    assert attach_mask_points(first) == ["model.create_causal_mask"]
    assert next(iter(first.model.named_children()))[0] == "create_causal_mask"


def _cache_names() -> tuple[str, str]:
    """The cache argument's name in this transformers' mask functions, and the other
    version's (5.24: ``cache``; 5.19, vLLM's pin: ``past_key_values``)."""
    names = ("cache", "past_key_values")
    own = next(
        n for n in names if n in inspect.signature(masking_utils.create_causal_mask).parameters
    )
    return own, next(n for n in names if n != own)


def test_a_call_with_a_config_no_attached_model_holds_builds_the_mask_as_before() -> None:
    model = _load("tiny-llama")
    config = type(model.config).from_dict(model.config.to_dict())
    config._attn_implementation = "eager"
    embeds = torch.zeros(1, 4, config.hidden_size)
    mask = torch.tensor([[0, 1, 1, 1]])
    routed = modeling_llama.create_causal_mask  # what the modeling file now holds
    plain = routed.__wrapped__
    cache = {_cache_names()[0]: None}
    built = routed(config=config, inputs_embeds=embeds, attention_mask=mask, **cache)
    expected = plain(config=config, inputs_embeds=embeds, attention_mask=mask, **cache)
    assert torch.equal(built, expected)


def test_a_mask_replayed_alone_is_always_built_and_takes_another_version_s_arguments() -> None:
    model = load_model(MODELS / "tiny-llama", "float32", attn_implementation="sdpa",
                       trust_remote_code=False)  # fmt: skip
    point = model.get_submodule("model.create_causal_mask")
    embeds = torch.zeros(1, 4, model.config.hidden_size)
    ones = torch.ones(1, 4, dtype=torch.long)
    own, other = _cache_names()
    # SDPA needs no mask for a causal row without padding: the model's call returns None
    assert point(inputs_embeds=embeds, attention_mask=ones, **{own: None}) is None
    # alone, the shortcut is off, and a None argument the function does not take (another
    # transformers' name for the cache) is dropped, the one it requires given None
    alone = point.alone(inputs_embeds=embeds, attention_mask=ones, **{other: None})
    assert alone.dtype == torch.bool and alone.shape == (1, 1, 4, 4)
    assert torch.equal(alone[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize(
    ("name", "points"),
    [("tiny-gemma2", ["model.create_causal_mask", "model.create_sliding_window_causal_mask"]),
     ("tiny-mistral", ["model.create_sliding_window_causal_mask"]),
     ("tiny-qwen3-next", ["model.create_causal_mask", "model.create_recurrent_attention_mask"]),
     ("tiny-qwen2-vl", ["model.language_model.create_causal_mask"]),
     ("tiny-bert", ["create_bidirectional_mask"])],
)  # fmt: skip
def test_the_zoo_s_sets_hold_each_mask_the_model_builds(name: str, points: list[str]) -> None:
    golden = GoldenSet.open(SETS / name)
    held = [p.name for p in golden.points if p.type == "MaskFunction"]
    assert held == points
    for point in held:  # stored as where each position attends, before the blocks
        call = next(iter(golden.point(point).calls.values()))[0]
        assert golden.tensor(call.outputs["0"]).dtype == torch.bool
        assert golden.point(point).order < golden.point(golden.points[-1].name).order


def test_the_logit_transform_is_a_point_where_the_model_changes_its_logits() -> None:
    gemma, llama = _load("tiny-gemma2"), _load("tiny-llama")
    transform = gemma.get_submodule("logit_transform")
    assert isinstance(transform, LogitTransform) and transform.changes_logits()
    # soft-capping at 30: 30 tanh(x / 30)
    x = torch.tensor([[[-90.0, 0.0, 45.0]]])
    with torch.no_grad():
        torch.testing.assert_close(transform(x), 30 * torch.tanh(x / 30))
    # Llama passes its head's output on unchanged: attached, but no point of it
    assert not llama.get_submodule("logit_transform").changes_logits()
    names = [p.name for p in GoldenSet.open(SETS / "tiny-gemma2").points]
    assert names[-2:] == ["lm_head", "logit_transform"]
    assert "logit_transform" not in [p.name for p in GoldenSet.open(SETS / "tiny-llama").points]
    # its calls: the head's golden output in, the model's golden logits out
    golden = GoldenSet.open(SETS / "tiny-gemma2")
    request = golden.requests[0].name
    call = golden.point("logit_transform").calls[request][0]
    assert call.args[0] == golden.point("lm_head").calls[request][0].outputs["0"]
    assert torch.equal(
        golden.tensor(call.outputs["0"]), golden.tensor(golden.manifest.logits[request])
    )
