"""The model verdict as result objects: every point's comparison, the first divergence (local
or accumulated), the logits' agreement, the greedy continuation's agreement and an encoder's
final outputs, each judged against the golden set's calibration. The model suites record
them (``records``) and fail with ``message``; the CLI can reuse them as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from numalign.compare import CompareResult
from numalign.compare.logits import LogitsStats
from numalign.record import DriftRecord


@dataclass
class PointResult:
    """One output of one call of a capture point (or of the model itself) in one request."""

    point: str
    order: int
    request: str
    path: str
    result: CompareResult
    mode: str = "accumulated"
    #: when the point's call completed in the forward (children before their parents)
    finished: int = 0
    #: the decode step (0: the prefill's cache) in decode replay; None elsewhere
    step: int | None = None
    #: which recorded call of the point in its request (0: the first)
    call: int = 0

    @property
    def label(self) -> str:
        return label(self.point, self.path)

    def record(self, test_id: str, **context: Any) -> DriftRecord:
        return DriftRecord.from_result(
            self.result, test_id=test_id, mode=self.mode, request=self.request,
            output=self.path, point_index=self.order, case=self.request, step=self.step,
            call=self.call, **context,
        )  # fmt: skip


@dataclass(frozen=True)
class Divergence:
    """The first point whose error leaves its budget in the whole-model replay; ``kind`` is
    ``local`` when the point fails alone too (fed the golden inputs), ``input`` when it fails
    alone fed one of the model's own inputs that no capture point covers (a mask, position
    embeddings), ``accumulated`` when the error comes with the hidden states from upstream,
    ``output`` when only the logits fail (the model's final logit transform)."""

    point: str
    kind: str
    request: str
    result: CompareResult
    #: for kind ``unlocated``: why the point could not be replayed alone; for ``output``:
    #: what the model does after its last capture point
    why_unlocated: str | None = None
    #: for kind ``input``: the inputs the model fed the point that make it fail alone, with
    #: how each differs from the golden one
    inputs: tuple[tuple[str, str], ...] = ()
    #: for kind ``accumulated``: a point before it that fails alone (the module at fault)
    named: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"point": self.point, "kind": self.kind, "request": self.request}
        if self.inputs:
            out["inputs"] = [name for name, _ in self.inputs]
        if self.kind == "output":
            out["why"] = str(self.why_unlocated)
        if self.named:
            out["named"] = self.named
        return out

    def describe(self) -> str:
        fed = "; ".join(f"{name} ({differs})" for name, differs in self.inputs)
        why = {
            "local": "the point alone fails too",
            "accumulated": "the point alone is within budget; the error comes with its hidden "
            "states from upstream"
            + (f", from {self.named}, which fails alone" if self.named else ""),
            "input": "the point alone on the golden inputs is within budget, and fails fed "
            f"the model's own {fed}: the fault is in how the model computes that input, "
            "which no capture point covers",
            "output": str(self.why_unlocated),
        }.get(self.kind, f"not replayed alone: {self.why_unlocated}")
        return (
            f"first divergence at {self.point} ({self.kind}: {why}), request {self.request}:\n"
            f"{self.result.message()}"
        )


@dataclass
class LogitsResult:
    """The logits of one request: their values against the calibrated budget (``values``:
    max abs, relative L2, distribution), and the agreement statistics, each judged: top-1
    and top-5 differences must be explained by near ties (golden logits within twice the
    max-abs budget), KL at most the squared spread times the control's plus a rounding floor.
    ``skipped`` says why nothing was judged (a set without logits calibration)."""

    request: str
    values: CompareResult | None
    stats: LogitsStats | None
    kl_budget: float = math.inf
    skipped: str | None = None
    #: the decode step of decode replay's logits; None for the prefill's
    step: int | None = None

    @property
    def problems(self) -> list[str]:
        if self.values is None or self.stats is None:
            return []
        out = []
        if not self.values.passed:
            out.append(f"values: {self.values.reason}")
        s = self.stats
        if s.top1_unexplained:
            out.append(
                f"top-1 differs at {s.top1_unexplained} of {s.positions} positions where the "
                f"golden logits are more than {s.near_tie:.3g} apart (not a near tie)"
            )
        if s.top5_unexplained:
            out.append(
                f"a golden top-5 token is pushed out at {s.top5_unexplained} of {s.positions} "
                f"positions by a token more than {s.near_tie:.3g} below it"
            )
        if s.kl_max > self.kl_budget:
            out.append(f"KL divergence {s.kl_max:.4g} exceeds its budget {self.kl_budget:.4g}")
        return out

    @property
    def passed(self) -> bool:
        return not self.problems

    def record(self, test_id: str, **context: Any) -> DriftRecord:
        if self.values is None or self.stats is None:
            return DriftRecord.for_test(
                test_id, "skipped", rule="skipped", reason=self.skipped, point="logits",
                mode="logits", request=self.request, case=self.request, step=self.step,
                **context,
            )  # fmt: skip
        record = DriftRecord.from_result(
            self.values, test_id=test_id, mode="logits", request=self.request,
            case=self.request, step=self.step, **context,
        )  # fmt: skip
        kl_used = self.stats.kl_max / self.kl_budget if self.kl_budget > 0 else 0.0
        used = max(record.used or 0.0, kl_used)
        record.metrics |= self.stats.to_dict()
        record.budget |= {"kl_max": self.kl_budget, "near_tie": self.stats.near_tie}
        if not self.passed:
            problems = self.problems
            record = record.with_fields(
                verdict="failed", rule=record.rule if not self.values.passed else "logits",
                reason="; ".join(problems),
                message=f"logits of {self.request}: " + "\n".join(problems)
                + ("\n" + self.values.message() if not self.values.passed else ""),
                budget_used=max(used, 1.0),
            )  # fmt: skip
        else:
            record.budget_used = used
        return record


@dataclass
class ContinuationResult:
    """Greedy tokens of the replay against the golden continuation, teacher-forced: identical
    up to ``first_divergence``, and there the two tokens' golden logits at most ``near_tie``
    apart (``gap``)."""

    request: str
    steps: int
    first_divergence: int | None
    gap: float
    near_tie: float

    @property
    def passed(self) -> bool:
        return self.first_divergence is None or self.gap <= self.near_tie

    def record(self, test_id: str, **context: Any) -> DriftRecord:
        where = (
            "every greedy token agrees"
            if self.first_divergence is None
            else f"first differing token at step {self.first_divergence}, golden logits "
            f"{self.gap:.3g} apart (near-tie allowance {self.near_tie:.3g})"
        )
        used = (
            0.0
            if self.first_divergence is None
            else (self.gap / self.near_tie if self.near_tie > 0 else math.inf)
        )
        return DriftRecord.for_test(
            test_id, "passed" if self.passed else "failed", point="continuation",
            mode="continuation", request=self.request, case=self.request,
            rule="continuation", reason=where, budget_used=used if math.isfinite(used) else None,
            metrics={"steps": self.steps, "first_divergence": self.first_divergence,
                     "gap": self.gap},
            budget={"near_tie": self.near_tie},
            message=None if self.passed else f"greedy continuation of {self.request}: {where}",
            **context,
        )  # fmt: skip


@dataclass
class ModelVerdict:
    """Everything a full-model replay judged, with the first divergence located."""

    points: list[PointResult]
    logits: list[LogitsResult] = field(default_factory=list)
    continuation: list[ContinuationResult] = field(default_factory=list)
    #: an encoder's final outputs (last hidden state, pooled output), mode "output"
    outputs: list[PointResult] = field(default_factory=list)
    divergence: Divergence | None = None
    #: points (or outputs) the engine has no counterpart for, with the reason: skipped records
    unmapped: dict[str, str] = field(default_factory=dict)

    @property
    def first_failing(self) -> PointResult | None:
        return first_divergence(self.points)

    @property
    def passed(self) -> bool:
        return (
            self.divergence is None
            and all(r.passed for r in self.logits)
            and all(r.passed for r in self.continuation)
            and all(o.result.passed for o in self.outputs)
        )

    def records(self, test_id: str, **context: Any) -> list[DriftRecord]:
        """One record per point output and request, per request's logits and continuation,
        and per final output; the divergent point's record carries the first divergence."""
        failing = self.first_failing
        out = []
        for r in self.points:
            record = r.record(test_id, **context)
            if self.divergence is not None and r is failing:
                record.first_divergence = self.divergence.to_dict()
            out.append(record)
        out += [o.record(test_id, **context) for o in self.outputs]
        # a divergence only the logits show (kind output) is carried by the first failing one
        pending = self.divergence is not None and failing is None
        for lg in self.logits:
            record = lg.record(test_id, **context)
            if pending and not lg.passed and self.divergence is not None:
                record.first_divergence = self.divergence.to_dict()
                pending = False
            out.append(record)
        out += [c.record(test_id, **context) for c in self.continuation]
        return out + unmapped_records(self.unmapped, test_id, "accumulated", **context)

    def message(self, title: str) -> str:
        problems = [self.divergence.describe()] if self.divergence is not None else []
        problems += [
            f"model output {o.label}, request {o.request}:\n{o.result.message()}"
            for o in self.outputs
            if not o.result.passed
        ]
        problems += [
            f"logits of {r.request}: " + "; ".join(r.problems) for r in self.logits if not r.passed
        ]
        problems += [
            f"greedy continuation of {c.request}: first differing token at step "
            f"{c.first_divergence}, golden logits {c.gap:.3g} apart (allowed {c.near_tie:.3g})"
            for c in self.continuation
            if not c.passed
        ]
        return f"{title}: " + "\n\n".join(problems)


def unmapped_records(
    unmapped: dict[str, str], test_id: str, mode: str, **context: Any
) -> list[DriftRecord]:
    """One skipped record per point an engine has no counterpart for, with the reason (the
    report counts them per model: what the engine's replay did not cover)."""
    return [
        DriftRecord.for_test(
            test_id, "skipped", rule="unmapped", reason=reason, point=point, mode=mode, **context
        )
        for point, reason in unmapped.items()
    ]


def label(point: str, path: str) -> str:
    """A point's output as messages and records name it: ``model.layers.0`` for a plain
    tensor output, ``model.layers.0.self_attn.0`` for an output inside a tuple."""
    return point if path == "0" else f"{point}.{path}"


def first_divergence(results: list[PointResult]) -> PointResult | None:
    """The first point, in the order calls completed in the forward (a block's norm before
    the block), whose error leaves its budget."""
    failing = [r for r in results if not r.result.passed]
    return min(failing, key=lambda r: r.finished) if failing else None


def layer_message(title: str, results: list[PointResult]) -> str | None:
    """The failure message of one point's layer replay (None when every output passed): how
    many outputs left the isolated budget, and the worst, once per test."""
    failed = [r for r in results if not r.result.passed]
    if not failed:
        return None
    w = worst(failed)
    requests = sorted({r.request for r in failed})
    return (
        f"{title} replayed alone leaves the isolated calibration's budget in {len(failed)} of "
        f"{len(results)} outputs (requests {', '.join(requests)}); worst, request "
        f"{w.request}:\n{w.result.message()}"
    )


def worst(results: list[PointResult]) -> PointResult:
    def used(r: PointResult) -> float:
        u = r.result.budget_used
        return math.inf if not r.result.passed and not math.isfinite(u) else u

    return max(results, key=used)
