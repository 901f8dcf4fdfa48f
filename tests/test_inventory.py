"""Inventory of a hybrid model: its mixers map to the catalogue operators they are (the
depthwise causal Conv1d to causal_conv1d, the gated delta rule, softplus), and what is truly
missing says so exactly (a gated RMSNorm is a form of rms_norm the catalogue lacks)."""

from __future__ import annotations

from pathlib import Path

import torch

from numalign.inventory import inventory
from numalign.registry import OPERATORS, load_catalogue

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
