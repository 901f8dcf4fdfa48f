"""Integer outputs of a capture point (GLM-DSA's sparse-attention indexer returns its top-k
key indices) are stored as selections and judged so: each row's values in any order, since a
top-k's order is its kernel's (the masked keys, tied at -inf, come out in any order); a
selection that differs fails. Boolean outputs are masks, compared elementwise. A decode step
leaves integer outputs out: their length is the cache's key count (a static cache's
capacity)."""

from __future__ import annotations

import torch

from numalign.compare import ControlErrors
from numalign.compare.calibration import Control
from numalign.compare.model_verdict import compare_point
from numalign.compare.output_kind import MASK, SELECTION
from numalign.golden.decode import new_token_output

#: Never used for integers (no budget applies), but compare_point takes one.
CONTROL = Control(ControlErrors(max_abs=0.0, rel_l2=0.0), reduction=1)
#: Two queries' top-4 key indices, as GLM-DSA's indexer returns them ([batch, query, k]).
EXPECTED = torch.tensor([[[3, 0, 2, 1], [1, 3, 0, 2]]], dtype=torch.int32)


def test_a_selection_in_another_order_passes() -> None:
    reordered = EXPECTED.flip(-1)
    assert compare_point(reordered, EXPECTED, "self_attn.2", CONTROL, None, SELECTION).passed


def test_a_different_selection_fails() -> None:
    wrong = EXPECTED.clone()
    wrong[0, 1, 0] = 5  # key 5 instead of key 1: one element of eight differs
    result = compare_point(wrong, EXPECTED, "self_attn.2", CONTROL, None, SELECTION)
    assert not result.passed and result.rule == "exact"


def test_booleans_are_compared_elementwise() -> None:
    mask = torch.tensor([[True, False, False, True]])
    moved = torch.tensor([[False, True, True, False]])  # the same count of True, elsewhere
    assert compare_point(mask.clone(), mask, "mask", CONTROL, None, MASK).passed
    assert not compare_point(moved, mask, "mask", CONTROL, None, MASK).passed


def test_a_decode_step_keeps_floating_new_token_rows_only() -> None:
    assert new_token_output(torch.zeros(2, 1, 64), batch=2)  # the new token's hidden states
    assert not new_token_output(torch.zeros(2, 1, 20, dtype=torch.int32), batch=2)  # indices
    assert not new_token_output(torch.zeros(2, 4, 1, 20), batch=2)  # attention weights
