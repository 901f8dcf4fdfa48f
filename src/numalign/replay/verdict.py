"""The model verdict's drift records: one per point output and request, per request's logits
and continuation, per final output and per point an engine has no counterpart for; the
divergent point's record carries the first divergence. The verdict itself (what passed,
why, the messages) is ``numalign.compare.model_verdict`` and ``compare.decode_verdict``;
``compare`` builds no records (``record`` sits above it), so the model suites turn a verdict
into records here (``records``, ``point_record``).
"""

from __future__ import annotations

import math
from typing import Any

from numalign.compare.decode_verdict import DecodeVerdict
from numalign.compare.model_verdict import (
    ContinuationResult,
    LogitsResult,
    ModelVerdict,
    PointResult,
)
from numalign.records.drift import DriftRecord


def records(
    verdict: ModelVerdict | DecodeVerdict, test_id: str, **context: Any
) -> list[DriftRecord]:
    """Every record of a whole-model or a decode replay's verdict."""
    if isinstance(verdict, DecodeVerdict):
        return decode_records(verdict, test_id, **context)
    return model_records(verdict, test_id, **context)


def point_record(result: PointResult, test_id: str, **context: Any) -> DriftRecord:
    """The record of one output of one call of a point in one request."""
    return DriftRecord.from_result(
        result.result, test_id=test_id, mode=result.mode, request=result.request,
        output=result.path, point_index=result.order, case=result.request, step=result.step,
        call=result.call, **context,
    )  # fmt: skip


def logits_record(logits: LogitsResult, test_id: str, **context: Any) -> DriftRecord:
    """The record of one request's logits (a skipped record where nothing was judged)."""
    if logits.values is None or logits.stats is None:
        return DriftRecord.for_test(
            test_id, "skipped", rule="skipped", reason=logits.skipped, point="logits",
            mode="logits", request=logits.request, case=logits.request, step=logits.step,
            **context,
        )  # fmt: skip
    record = DriftRecord.from_result(
        logits.values, test_id=test_id, mode="logits", request=logits.request,
        case=logits.request, step=logits.step, **context,
    )  # fmt: skip
    # a NaN use (non-finite values) ranks as the worst, never dropped by max()
    used = max(math.inf if math.isnan(u) else u for u in (logits.kl_used, record.used or 0.0))
    record.metrics |= logits.stats.to_dict()
    record.budget |= {"kl_max": logits.kl_budget, "near_tie": logits.stats.near_tie}
    if logits.passed:
        record.budget_used = used
        return record
    return record.with_fields(
        verdict="failed", rule=record.rule if not logits.values.passed else "logits",
        reason="; ".join(logits.problems), message=logits.message(),
        budget_used=max(used, 1.0),
    )  # fmt: skip


def continuation_record(
    continuation: ContinuationResult, test_id: str, **context: Any
) -> DriftRecord:
    """The record of one request's greedy continuation."""
    c = continuation
    return DriftRecord.for_test(
        test_id, "passed" if c.passed else "failed", point="continuation",
        mode="continuation", request=c.request, case=c.request, rule="continuation",
        reason=c.reason, budget_used=c.budget_used,
        metrics={"steps": c.steps, "first_divergence": c.first_divergence, "gap": c.gap},
        budget={"near_tie": c.near_tie},
        message=None if c.passed else f"greedy continuation of {c.request}: {c.reason}",
        **context,
    )  # fmt: skip


def model_records(verdict: ModelVerdict, test_id: str, **context: Any) -> list[DriftRecord]:
    """One record per point output and request, per request's logits and continuation,
    and per final output; the divergent point's record carries the first divergence."""
    failing = verdict.first_failing
    divergence = verdict.divergence
    out = []
    for r in verdict.points:
        record = point_record(r, test_id, **context)
        if divergence is not None and r is failing:
            record.first_divergence = divergence.to_dict()
        out.append(record)
    out += [point_record(o, test_id, **context) for o in verdict.outputs]
    # a divergence only the logits show (kind output) is carried by the first failing one
    pending = divergence is not None and failing is None
    for lg in verdict.logits:
        record = logits_record(lg, test_id, **context)
        if pending and not lg.passed and divergence is not None:
            record.first_divergence = divergence.to_dict()
            pending = False
        out.append(record)
    out += [continuation_record(c, test_id, **context) for c in verdict.continuation]
    return out + unmapped_records(verdict.unmapped, test_id, "accumulated", **context)


def decode_records(verdict: DecodeVerdict, test_id: str, **context: Any) -> list[DriftRecord]:
    """One record per step's point output and cache state and per step's logits; the
    divergent point's record carries the first divergence."""
    divergence = verdict.divergence
    out = []
    for r in verdict.points:
        record = point_record(r, test_id, **context)
        if divergence is not None and verdict.is_divergent(r, divergence):
            record.first_divergence = divergence.to_dict()
        out.append(record)
    out += [logits_record(lg, test_id, **context) for lg in verdict.logits]
    return out + unmapped_records(verdict.unmapped, test_id, "decode", **context)


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
