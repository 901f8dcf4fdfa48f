"""Inventory of a hybrid model: its mixers map to the catalogue operators they are (the
depthwise causal Conv1d to causal_conv1d, the gated delta rule, softplus), and what is truly
missing says so exactly (a gated RMSNorm is a form of rms_norm the catalogue lacks)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from numalign.ops.inventory import inventory
from numalign.ops.registry import OPERATORS, load_catalogue

QWEN3_NEXT = Path(__file__).resolve().parents[1] / "golden" / "models" / "tiny-qwen3-next"


def test_the_mixers_of_a_hybrid_model_map_to_catalogue_operators() -> None:
    rows = {row["operator"]: row for row in inventory(QWEN3_NEXT).rows}
    assert rows["causal_conv1d"]["where"] == [
        "model.layers.0.linear_attn.conv1d", "model.layers.2.linear_attn.conv1d",
    ]  # fmt: skip
    assert rows["gated_delta_rule"]["where"] == [
        "model.layers.0.linear_attn", "model.layers.2.linear_attn",
    ]  # fmt: skip
    assert rows["softplus"]["status"] == "covered by candidates"
    assert "(module Conv1d)" not in rows and "(aten.softplus)" not in rows
    assert rows["(module Qwen3NextRMSNormGated)"]["status"] == (
        "missing: a form of rms_norm the catalogue lacks"
    )


def test_only_a_depthwise_causal_conv1d_is_causal_conv1d() -> None:
    load_catalogue()
    conv = OPERATORS["causal_conv1d"]
    assert conv.stands_for_module(torch.nn.Conv1d(8, 8, 4, groups=8, padding=3))
    assert not conv.stands_for_module(torch.nn.Conv1d(8, 16, 3, padding=1))  # an audio stem
    assert not conv.stands_for_module(torch.nn.Conv1d(8, 8, 4, groups=8, padding=0))


ZOO = QWEN3_NEXT.parent


def _operators(model: str | Path) -> dict[str, dict[str, object]]:
    return {row["operator"]: row for row in inventory(ZOO / model if isinstance(model, str)
                                                      else model).rows}  # fmt: skip


def test_a_default_rope_is_not_a_scaled_rope() -> None:
    rows = _operators("tiny-llama")
    assert rows["rope_neox"]["where"] == ["model.rotary_emb"]
    assert "rope_scaled" not in rows


def test_a_rope_whose_config_names_a_scaling_is_a_scaled_rope(tmp_path: Path) -> None:
    config = json.loads((ZOO / "tiny-llama" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    config.pop("rope_scaling", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _operators(tmp_path)["rope_scaled"]["where"] == ["model.rotary_emb"]


def test_tanh_is_logit_softcapping_only_where_the_config_soft_caps() -> None:
    assert "logit_softcap" not in _operators("tiny-bert")  # its pooler's tanh
    assert _operators("tiny-gemma2")["logit_softcap"]["where"] == ["aten.tanh"]


def test_layers_are_listed_in_their_order() -> None:
    where = _operators("tiny-deep-llama")["rms_norm"]["where"]
    layers = [int(n.split(".")[2]) for n in where if n.startswith("model.layers.")]
    assert layers == sorted(layers) and layers[-1] >= 10  # a deep model: two-digit layers
