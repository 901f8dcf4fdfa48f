"""Selections are judged index by index with the scores they select (``compare.exact``): a
top-k whose values are right but whose indices come in scan order, or a sort whose indices
are not carried through its last pass, fails; honest choices among tied scores pass, and
the message counts the index differences that are not among ties."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from numalign.compare import CompareSpec, compare
from numalign.ops.check import check_operator
from numalign.ops.registry import OPERATORS, Candidate, load_catalogue

CPU = torch.device("cpu")


def _run(operator: str, case_name: str, fn: Any) -> dict[str, Any]:
    """The results of ``fn`` as a candidate of ``operator`` on its case ``case_name`` in
    float32, by output name."""
    load_catalogue()
    op = OPERATORS[operator]
    case = next(c for c in op.cases if c.name == case_name)
    candidate = Candidate(operator=operator, name="planted", fn=fn)
    results = check_operator(op, candidate, case, torch.float32, CPU)
    return {r.name.split(".")[-1]: r for r in results}


def _topk_scan_order(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The right values, their indices listed in ascending (scan) order."""
    result = torch.topk(x, k, dim=-1)
    return result.values, result.indices.sort(dim=-1).values


def _sort_payload_left_behind(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted values; the indices reversed within each run of four ranks, as a last pass
    that moved the keys without their payload leaves them."""
    result = torch.sort(x, dim=-1)
    n = x.shape[-1] - x.shape[-1] % 4
    head = result.indices[..., :n].unflatten(-1, (-1, 4)).flip(-1).flatten(-2)
    return result.values, torch.cat([head, result.indices[..., n:]], dim=-1)


def _topk_last_among_ties(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An honest top-k that picks the highest index among tied values (the reference picks
    the lowest)."""
    n = x.shape[-1]
    result = torch.topk(x.flip(-1), k, dim=-1)
    return result.values, n - 1 - result.indices


def test_a_top_k_with_right_values_and_indices_in_scan_order_fails() -> None:
    results = _run("topk", "rows-8x1000-k8", _topk_scan_order)
    assert results["values"].passed, results["values"].message()
    indices = results["indices"]
    assert not indices.passed and indices.rule == "ties", indices.message()
    assert "not tied with the reference's at the same rank" in indices.reason
    assert "out of rank" in (indices.hint or "")


def test_a_sort_whose_indices_miss_its_last_pass_fails() -> None:
    results = _run("sort", "rows-4x1000", _sort_payload_left_behind)
    assert results["values"].passed, results["values"].message()
    indices = results["indices"]
    assert not indices.passed and indices.rule == "ties", indices.message()
    # every index moves (4 rows of 1000); random float32 values tie within float32's
    # tolerance (rtol 1.3e-6) only by rare chance: a handful of the 4000 at most
    assert indices.metrics.mismatch_count >= 4000 - 10


def test_an_honest_top_k_picking_other_tied_indices_passes() -> None:
    results = _run("topk", "ties-16x64-k5", _topk_last_among_ties)
    indices = results["indices"]
    assert indices.passed, indices.message()
    # it did pick other indices than the reference (values drawn from a handful of levels)
    assert "index difference(s), each selecting a score tied" in indices.reason


def test_the_message_counts_index_differences_not_among_ties() -> None:
    scores = torch.tensor([[0.9, 0.1, 0.9, 0.5, 0.7]])
    reference = torch.tensor([[0, 2, 4, 3]])  # 0.9, 0.9, 0.7, 0.5
    # ranks 0 and 1 swap tied 0.9s (allowed); ranks 2 and 3 swap 0.7 and 0.5 (not tied)
    result = compare(torch.tensor([[2, 0, 3, 4]]), reference, CompareSpec(ties=scores))
    assert not result.passed
    assert result.reason.startswith(
        "2 of 4 index difference(s) select a score not tied with the reference's at the same rank"
    )
    assert "2 are among tied scores" in result.reason
    assert result.metrics.mismatch_count == 2


@pytest.mark.parametrize(
    ("candidate", "passes"),
    [([0, 3, 5], True),  # index 3 ties index 1 (0.5): another honest choice, in index order
     ([0, 1, 5], True),  # the reference's own
     ([5, 0, 1], False),  # the right set, not in the reference's (ascending index) order
     ([0, 2, 5], False)],  # 0.2 is not tied with 0.5
)  # fmt: skip
def test_a_set_listed_by_index_may_choose_among_ties_but_keeps_its_order(
    candidate: list[int], passes: bool
) -> None:
    # the three highest scores listed by index, as a router lists its experts: their scores
    # (0.9, 0.5, 0.9) are not monotone, so the reference's order is the index order
    scores = torch.tensor([[0.9, 0.5, 0.2, 0.5, 0.1, 0.9]])
    reference = torch.tensor([[0, 1, 5]])
    result = compare(torch.tensor([candidate]), reference, CompareSpec(ties=scores))
    assert result.passed is passes, result.message()
