"""A known divergence's signature: whether a failed decode verdict erred exactly as a model
with the known fault does (``replay.serving.known_divergence`` runs that model; the rule is
here).

The signature model (the reference with the engine's known gap reproduced: no attention
soft-capping, say) hands on its pairs like any decode replay. ``Signature`` keeps each
pair's errors and each point's pooled lean; ``unexplained`` names the verdict's failures the
signature does not explain: a failing point or logits whose errors differ from the
signature's by more than their own budget, or a pooled lean the signature does not lean the
same way. A verdict with nothing unexplained is the known divergence, an expected failure;
anything beyond it (a planted bug on top) fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from numalign.compare.calibration import OUTPUT_POINT
from numalign.compare.lean import Lean, LeanSums
from numalign.compare.logits import logits_stats
from numalign.compare.metrics import compute_metrics
from numalign.compare.pooled import POOLED

if TYPE_CHECKING:
    import torch

    from numalign.compare.decode_verdict import DecodeVerdict

#: A pair's key: (request, step, point, path, call).
PairKey = tuple[str, int, str, str, int]


@dataclass
class Signature:
    """The signature model's errors per pair (max abs, relative L2, and for logits the KL)
    and its pooled leans per point output."""

    errors: dict[PairKey, tuple[float, float, float]] = field(default_factory=dict)
    leans: dict[tuple[str, str], LeanSums] = field(default_factory=dict)

    def add(self, request: str, step: int, point: str, path: str, actual: torch.Tensor,
            expected: torch.Tensor, call: int = 0) -> None:  # fmt: skip
        """One pair of the signature model's decode (a decode replay's ``OnPair``)."""
        m = compute_metrics(actual, expected)
        kl = logits_stats(actual, expected, 0.0).kl_max if point == OUTPUT_POINT else 0.0
        self.errors[(request, step, point, path, call)] = (m.max_abs, m.rel_l2, kl)
        self.leans.setdefault((point, path), LeanSums()).add(actual, expected)


def unexplained(verdict: DecodeVerdict, signature: Signature) -> list[str]:
    """The failing results of ``verdict`` whose errors differ from the signature model's by
    more than their budget, each named."""
    out = []
    for r in verdict.points:
        if r.result.passed:
            continue
        if r.request == POOLED:  # a pooled lean: against the signature model's own lean
            sums = signature.leans.get((r.point, r.path))
            if sums is None or not same_lean(r.result.budget, sums.finish()):
                out.append(f"{r.point}'s pooled lean")
            continue
        errors = signature.errors.get((r.request, r.step or 0, r.point, r.path, r.call))
        if errors is None or not _within(r.result, errors[:2]):
            out.append(f"{r.point} at step {r.step}, request {r.request}")
    for lg in verdict.logits:
        if lg.passed or lg.values is None or lg.stats is None:
            continue
        errors = signature.errors.get((lg.request, lg.step or 0, OUTPUT_POINT, "logits", 0))
        # to second order a KL divergence is a squared distance (half the chi-squared of the
        # log-ratio), so the engine's and the signature's distances from the reference differ
        # by at most the distance between them: within the budget's when they agree
        kl_ok = errors is not None and abs(
            math.sqrt(max(lg.stats.kl_max, 0.0)) - math.sqrt(max(errors[2], 0.0))
        ) <= math.sqrt(lg.kl_budget)
        if errors is None or not (_within(lg.values, errors[:2]) and kl_ok):
            out.append(f"the logits at step {lg.step}, request {lg.request}")
    return out


def same_lean(budget: dict[str, float], signature: Lean | None) -> bool:
    """The engine's pooled lean (``budget``'s ``lean_scale`` and ``lean_offset``, from
    ``compare.pooled``) is one the signature model explains: of the signature's sign where it
    leans beyond the honest range, and no larger than the signature's lean plus the honest
    range's width (widened by the upstream allowance both ways) and three standard errors of
    each (the signature decodes with the reference's cache, so its steps' errors differ in
    detail, not in kind)."""
    if signature is None:
        return False
    upstream = budget.get("lean_upstream", 0.0)
    for kind in ("scale", "offset"):
        width = budget.get(f"{kind}_high", 0.0) - budget.get(f"{kind}_low", 0.0) + 2 * upstream
        se = math.hypot(budget.get(f"lean_{kind}_se", 0.0), getattr(signature, f"{kind}_se"))
        engine, explained = budget.get(f"lean_{kind}", 0.0), getattr(signature, kind)
        allowed = width + 3 * se
        if abs(engine) > allowed and (
            engine * explained < 0 or abs(engine) > abs(explained) + allowed
        ):
            return False
    return True


def _within(result: Any, errors: tuple[float, float]) -> bool:
    """The result's max abs and relative L2 errors equal the signature's within its budget."""
    budget, metrics = result.budget, result.metrics
    same_max = abs(metrics.max_abs - errors[0]) <= budget.get("max_abs", 0.0)
    return bool(same_max and abs(metrics.rel_l2 - errors[1]) <= budget.get("rel_l2", 0.0))
