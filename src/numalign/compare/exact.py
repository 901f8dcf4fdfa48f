"""The exact rules: integer, boolean and index outputs equal (rule "exact"), or index
selections that may differ only among tied scores (rule "ties")."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from numalign.compare.budgets import Decision, ExactBudget, ToleranceBudget
from numalign.compare.metrics import Metrics, compute_metrics
from numalign.compare.tolerances import DTYPE_TOLERANCES, Tolerance
from numalign.dtypes import dtype_name

if TYPE_CHECKING:
    import torch


def attends(mask: torch.Tensor) -> torch.Tensor:
    """Where an attention mask lets attention through: a boolean mask as it is, an additive
    float mask's entries above its dtype's most negative half (a masked entry is the minimum
    or -inf), an integer one's nonzero entries (a padding mask of ones and zeros)."""
    import torch

    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask > torch.finfo(mask.dtype).min / 2
    return mask != 0


def judge_exact(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    ties: torch.Tensor | None,
    tolerance: Tolerance | None,
    name: str,
) -> tuple[Decision, Metrics]:
    """Exact outputs equal (within ``tolerance.atol`` where one is given), or with ``ties``
    (the scores the indices select from) a selection equal up to ties: the decision and the
    metrics it was taken on."""
    a = actual.detach().cpu()
    e = expected.detach().to(a.device)
    if ties is not None:
        return judge_ties(a, e, ties.detach().cpu(), name)
    atol = tolerance.atol if tolerance is not None else 0.0
    threshold = atol if atol > 0 else None
    metrics = compute_metrics(a, e, threshold=threshold)
    if threshold is None:
        metrics = replace(metrics, mismatch_count=int((a != e).sum()))
    budget = ExactBudget(atol, source="explicit" if atol else "exact")
    if metrics.mismatch_count:
        m = metrics
        return Decision(
            "exact", False,
            f"{m.mismatch_count} of {m.numel} exact outputs differ"
            + (f" by more than {atol:g}" if atol else ""),
            f"the worst difference is at {m.worst_index} (actual {m.worst_actual:g}, expected "
            f"{m.worst_expected:g}): check off-by-one masks, index arithmetic and "
            "tie-breaking",
            used=math.inf, budget=budget,
        ), metrics  # fmt: skip
    return Decision("exact", True, "all exact outputs are equal", budget=budget), metrics


def judge_ties(
    a: torch.Tensor, e: torch.Tensor, scores: torch.Tensor, name: str
) -> tuple[Decision, Metrics]:
    """Index outputs that may differ only where the selected scores tie."""
    import torch

    n = scores.shape[-1] if scores.dim() else 0
    metrics = compute_metrics(a, e)
    if a.is_floating_point() or a.dtype == torch.bool:
        raise ValueError(f"{name}: ties= needs integer index outputs, got {a.dtype}")
    invalid = _invalid_selection(a, n)
    if invalid is not None:
        return invalid, metrics
    if a.shape[:-1] != scores.shape[:-1]:
        raise ValueError(
            f"{name}: ties= scores of shape {tuple(scores.shape)} do not match indices "
            f"of shape {tuple(a.shape)} in the leading dimensions"
        )
    picked_a = scores.gather(-1, a.long()).to(torch.float64)
    picked_e = scores.gather(-1, e.long()).to(torch.float64)
    tol = DTYPE_TOLERANCES.get(dtype_name(scores.dtype), DTYPE_TOLERANCES["float64"])
    # Order within tied values is free: compare the selected scores sorted.
    sa = picked_a.sort(dim=-1, descending=True).values
    se = picked_e.sort(dim=-1, descending=True).values
    untied = (sa - se).abs() > tol.atol + tol.rtol * se.abs()
    index_diff = int((a != e).sum())
    budget = ToleranceBudget(
        tol.rtol, tol.atol, source="dtype",
        why="scores within the tolerance of their dtype are tied: either may be selected",
    )  # fmt: skip
    count = int(untied.sum())
    metrics = replace(metrics, mismatch_count=count)
    if count:
        return Decision(
            "ties", False,
            f"{count} selected score(s) are not tied with the reference's selection within "
            f"rtol={tol.rtol:g}, atol={tol.atol:g}",
            "the candidate selects different elements, not a different order among ties: "
            "check the comparison direction, masking before selection and k",
            budget=budget,
        ), metrics  # fmt: skip
    return Decision(
        "ties", True,
        f"selections agree ({index_diff} index difference(s), all among tied scores)",
        budget=budget,
    ), metrics  # fmt: skip


def _invalid_selection(a: torch.Tensor, n: int) -> Decision | None:
    """An index out of [0, n) or selected twice in one row: no selection of ``n`` scores."""
    if bool(((a < 0) | (a >= n)).any()):
        bad = tuple(int(i) for i in ((a < 0) | (a >= n)).nonzero()[0])
        return Decision(
            "ties", False, f"index out of range [0, {n}) at {bad}",
            "check the index base and the length of the selected dimension",
        )  # fmt: skip
    if a.numel() and a.shape[-1] > 1:
        sorted_idx = a.sort(dim=-1).values
        if bool((sorted_idx[..., 1:] == sorted_idx[..., :-1]).any()):
            return Decision(
                "ties", False, "an index is selected twice in one row",
                "top-k and sort must select distinct positions",
            )  # fmt: skip
    return None
