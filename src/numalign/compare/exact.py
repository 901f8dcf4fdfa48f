"""The exact rules: integer, boolean and index outputs equal (rule "exact"), index
selections that may differ only among tied scores (rule "ties"), and attention masks: where
they attend (``attends``, rule "exact"), what an additive mask fills its masked entries with
(``fill_faults``, rule "non-finite"), and what is wrong in the rows a comparison leaves out
(``judge_left_out``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from numalign.compare.budgets import Decision, ExactBudget, ToleranceBudget
from numalign.compare.cause import Cause
from numalign.compare.metrics import Metrics, compute_metrics
from numalign.compare.result import CompareResult
from numalign.compare.tolerances import DTYPE_TOLERANCES, Tolerance
from numalign.core.dtypes import dtype_name

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


def fill_faults(mask: torch.Tensor) -> torch.Tensor:
    """The entries of an additive (floating) attention mask that break the softmax they are
    added before, as a boolean tensor of its shape: NaN anywhere, +inf anywhere, and -inf in
    a row (the last dimension: the keys) that attends nowhere, whose softmax is then 0/0
    where the reference's finite minimum (transformers' ``torch.finfo(dtype).min``) gives
    finite weights. -inf in a row that attends somewhere zeroes its scores exactly and is
    no fault. A boolean or integer mask has none."""
    import torch

    if not mask.is_floating_point():
        return torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
    nowhere = ~attends(mask).any(-1, keepdim=True)
    return mask.isnan() | mask.isposinf() | (mask.isneginf() & nowhere)


def judge_mask(
    actual: torch.Tensor, expected: torch.Tensor, *, name: str
) -> tuple[Decision, Metrics]:
    """A mask the candidate built (boolean, integer, or additive floating) against the
    truth's where-it-attends (boolean): ``attends`` of it equal to the truth (rule "exact":
    an additive entry attends above half its dtype's minimum, so a masked entry lies far
    enough below any score that its weight underflows to zero), then no ``fill_faults``
    (rule "non-finite")."""
    import torch

    a = actual.detach().cpu()
    where = attends(a)
    decision, metrics = judge_exact(where, expected, ties=None, tolerance=None, name=name)
    if not a.is_floating_point():
        return decision, metrics
    if not decision.passed:
        at = tuple(int(i) for i in (where != expected.to(where.device)).nonzero()[0])
        limit = torch.finfo(a.dtype).min / 2
        hint = (
            f"the candidate's additive mask holds {float(a[at]):g} at {at}: an entry attends "
            f"above {limit:g} (half of {dtype_name(a.dtype)}'s minimum), and a masked entry "
            f"must lie at or below it (fill with torch.finfo({dtype_name(a.dtype)}).min), low "
            "enough that its weight underflows to zero after softmax; check the fill, the "
            "padding and the window"
        )
        return replace(decision, hint=hint), metrics
    faults = fill_faults(a)
    count = int(faults.sum())
    if not count:
        return decision, metrics
    at = tuple(int(i) for i in faults.nonzero()[0])
    nan, posinf = int(a.isnan().sum()), int(a.isposinf().sum())
    rows = int(faults.any(-1).sum())
    minimum = float(torch.finfo(a.dtype).min)
    return Decision(
        "non-finite", False,
        f"the additive mask's fill breaks softmax at {count} entries in {rows} row(s) "
        f"({nan} NaN, {posinf} +inf, {count - nan - posinf} -inf in rows that attend "
        f"nowhere); the first at {at} holds {float(a[at]):g}",
        f"fill masked entries with torch.finfo({dtype_name(a.dtype)}).min ({minimum:g}), as "
        "the reference does: a row that attends nowhere (a left-padding query) then gets "
        "finite weights, where -inf gives 0/0 = NaN and NaN poisons its row; the NaN reaches "
        "the real rows at the next attention",
        used=math.inf,
    ), replace(metrics, mismatch_count=count)  # fmt: skip


@dataclass(frozen=True)
class LeftOut:
    """What is wrong in the rows a comparison leaves out (a request's padding positions):
    ``rows``, the (batch, position) of each left-out row that holds a fault; ``entries``, how
    many faulty entries; ``of``, how many rows were left out; ``what``, "values" (NaN or Inf
    where the truth is finite) or "fill" (an additive mask's ``fill_faults``)."""

    rows: tuple[tuple[int, int], ...]
    entries: int
    of: int
    what: str = "values"


def judge_left_out(result: CompareResult, left_out: LeftOut | None) -> CompareResult:
    """``result`` failed (rule "non-finite") where ``left_out`` holds faults: a value that is
    not finite in a padding row reaches the real rows at the next attention (its value row,
    weighted by zero, is still NaN), so it fails at the point that produced it; unchanged
    where there are none."""
    if left_out is None or not left_out.rows:
        return result
    shown = ", ".join(str(r) for r in left_out.rows[:8])
    more = f" and {len(left_out.rows) - 8} more" if len(left_out.rows) > 8 else ""
    what = (
        "NaN or Inf value(s) where the reference is finite"
        if left_out.what == "values"
        else "mask entries whose fill breaks softmax (NaN, +inf, or -inf in rows that attend "
        "nowhere)"
    )
    reason = (
        f"{left_out.entries} {what} in {len(left_out.rows)} of the {left_out.of} padding "
        f"row(s) the comparison leaves out, at (batch, position) {shown}{more}"
    )
    if not result.passed:
        reason = f"{reason}; and {result.reason}"
    return replace(
        result, passed=False, rule="non-finite", reason=reason,
        budget_used=max(result.budget_used, 1.0), cause=Cause("nonfinite", reason, 1.0),
        hint=(
            "padding rows are left out of the comparison, not out of the model: a NaN there "
            "reaches the real rows at the next attention; check rows that attend nowhere "
            "(fill masked entries with torch.finfo(dtype).min, not -inf: softmax over -inf "
            "alone is 0/0), 0/0 in normalizations of padding, and overflow"
        ),
    )  # fmt: skip


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
    """Index outputs judged with the scores they select (``scores``, along the last
    dimension), each index with its score: the candidate's indices may differ from the
    truth's only where the scores they select are tied within the scores' dtype tolerance.

    The truth's order is the selection's contract. Where every row of the truth's selected
    scores is monotone (a top-k, a sort: ranked by score), the candidate's index at each rank
    must select a score tied with the truth's at that rank, so indices listed in scan order
    or left behind by a sort's last pass fail though the values are right. Where every row of
    the truth's indices is ascending (a set listed by index: a router's experts, kept
    blocks), the candidate's rows must be ascending too and select scores tied with the
    truth's as a multiset. A truth that keeps both orders accepts either."""
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
    tol = DTYPE_TOLERANCES.get(dtype_name(scores.dtype), DTYPE_TOLERANCES["float64"])
    picked_a = scores.gather(-1, a.long()).to(torch.float64)
    picked_e = scores.gather(-1, e.long()).to(torch.float64)
    budget = ToleranceBudget(
        tol.rtol, tol.atol, source="dtype",
        why="scores within the tolerance of their dtype are tied: either may be selected",
    )  # fmt: skip
    ranked = _by_rank(a, e, picked_a, picked_e, tol) if _ranked(picked_e) else None
    decision, count = ranked or (None, 0)
    if decision is None or (not decision.passed and _ascending(e)):
        by_index = _by_index(a, e, picked_a, picked_e, tol)
        if decision is None or by_index[0].passed:
            decision, count = by_index
    metrics = replace(metrics, mismatch_count=count)
    return replace(decision, budget=budget), metrics


def _tied(x: torch.Tensor, y: torch.Tensor, tol: Tolerance) -> torch.Tensor:
    """Where two scores are tied: equal (infinities included) or within ``tol`` of ``y``."""
    return (x == y) | ((x - y).abs() <= tol.atol + tol.rtol * y.abs())


def _ranked(picked: torch.Tensor) -> bool:
    """Whether every row of selected scores is monotone (either way): ranked by score."""
    if picked.shape[-1] < 2:
        return True
    down = (picked[..., 1:] <= picked[..., :-1]).all(-1)
    up = (picked[..., 1:] >= picked[..., :-1]).all(-1)
    return bool((down | up).all())


def _ascending(indices: torch.Tensor) -> bool:
    """Whether every row of indices is strictly ascending: a set listed by index."""
    return indices.shape[-1] < 2 or bool((indices[..., 1:] > indices[..., :-1]).all())


def _by_rank(
    a: torch.Tensor,
    e: torch.Tensor,
    picked_a: torch.Tensor,
    picked_e: torch.Tensor,
    tol: Tolerance,
) -> tuple[Decision, int]:
    """A selection ranked by score: each rank's index selects a score tied with the truth's
    at that rank; the decision and the count of index differences among untied scores."""
    differ = a != e
    untied = differ & ~_tied(picked_a, picked_e, tol)
    count, differences = int(untied.sum()), int(differ.sum())
    within = f"rtol={tol.rtol:g}, atol={tol.atol:g}"
    if not count:
        return Decision("ties", True, _agree(differences, within)), 0
    at = tuple(int(i) for i in untied.nonzero()[0])
    reason = (
        f"{count} of {differences} index difference(s) select a score not tied with the "
        f"reference's at the same rank ({within}); {differences - count} are among tied "
        f"scores; the first at {at}: index {int(a[at])} (score {float(picked_a[at]):g}) "
        f"where the reference selects {int(e[at])} (score {float(picked_e[at]):g})"
    )
    same_set = bool(_tied(picked_a.sort(-1).values, picked_e.sort(-1).values, tol).all())
    hint = (
        "the candidate selects the right elements but lists them out of rank: each index "
        "must stay with its value (a sort carries its indices through every pass; a top-k "
        "lists its indices in the order of its values, not in scan order)"
        if same_set
        else "the candidate selects different elements, not a different order among ties: "
        "check the comparison direction, masking before selection and k"
    )
    return Decision("ties", False, reason, hint), count


def _by_index(
    a: torch.Tensor,
    e: torch.Tensor,
    picked_a: torch.Tensor,
    picked_e: torch.Tensor,
    tol: Tolerance,
) -> tuple[Decision, int]:
    """A set: selecting scores tied with the truth's as a multiset, its rows ascending where
    the truth's are (listed by index); the decision and the count of selected scores not
    tied with the truth's."""
    import torch

    within = f"rtol={tol.rtol:g}, atol={tol.atol:g}"
    if _ascending(e) and not _ascending(a):
        rows = int((a[..., 1:] <= a[..., :-1]).any(-1).sum())
        return Decision(
            "ties", False,
            f"{rows} row(s) of the selection are not in ascending index order, the "
            "reference's order for this selection",
            "list the selected indices in ascending order, as the reference does (sort them "
            "after selecting; the scores they select stay paired with them)",
        ), rows  # fmt: skip
    sa, se = picked_a.sort(-1).values, picked_e.sort(-1).values
    count = int((~_tied(sa, se, tol)).sum())
    # the candidate's indices the truth's row does not hold: what differs as a set
    held = e.sort(-1).values.contiguous()
    found = torch.searchsorted(held, a.contiguous()).clamp_max(max(e.shape[-1] - 1, 0))
    differences = int((held.gather(-1, found) != a).sum()) if a.numel() else 0
    if not count:
        return Decision("ties", True, _agree(differences, within)), 0
    return Decision(
        "ties", False,
        f"{count} selected score(s) are not tied with the reference's selection ({within}); "
        f"{differences} index(es) differ from the reference's set",
        "the candidate selects different elements, not other elements among ties: check "
        "the comparison direction, masking before selection and k",
    ), count  # fmt: skip


def _agree(differences: int, within: str) -> str:
    """The passing reason: how many indices differ, each selecting a tied score."""
    if not differences:
        return "selections are equal"
    return (
        f"selections agree ({differences} index difference(s), each selecting a score tied "
        f"within {within} with the reference's)"
    )


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
