"""Where a whole-model replay's first divergence lives: the rule, for every engine.

The judge asks the engine to replay points alone on the golden inputs (``Alone``) and decides
from the answers: ``local`` when the first failing point fails alone too; ``input`` when it
fails alone fed one of the model's own inputs no capture point covers (a mask, position
embeddings); ``accumulated`` when the error reaches it from upstream, naming the latest point
before it that fails alone where one does; ``unlocated`` when the point cannot run alone;
``output`` when every point passes and only the logits fail, after the last capture point.
An engine that cannot take a model's own inputs (vLLM) answers ``inputs_at_fault`` with None.

A decode step's first failing point is located the same way on the input the replay fed it
(``locate_in_step``): its own error against the module in float32 on that input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from numalign.compare.calibration import OUTPUT_POINT
from numalign.compare.model_verdict import (
    DecodeLocation,
    Divergence,
    LogitsResult,
    PointResult,
    first_divergence,
)
from numalign.compare.pooled import POOLED
from numalign.core.errors import Unsupported

if TYPE_CHECKING:
    from numalign.compare.result import CompareResult
    from numalign.core.observation import Observation

#: How many points before an accumulated divergence are replayed alone to find the one that
#: errs itself: a block's worth (norms, attention, MLP) and the block before it.
UPSTREAM_POINTS = 8


class Alone(Protocol):
    """What an engine offers the judge to locate a divergence."""

    def replay_alone(self, point: str) -> list[PointResult]:
        """Every recorded call of ``point`` replayed alone on the golden inputs, judged in
        mode ``isolated``; ``numalign.core.errors.Unsupported`` saying why where it cannot run
        alone (or the set has no such point)."""
        ...

    def inputs_at_fault(self, failing: PointResult) -> tuple[tuple[str, str], ...] | None:
        """The model's own keyword inputs of ``failing``'s call that make it fail alone, each
        with how it differs from the golden one; None where the engine cannot take them."""
        ...


def fails_alone(engine: Alone, point: str) -> bool:
    """Whether ``point`` fails replayed alone, its pooled lean included (False where it
    cannot run alone)."""
    try:
        alone = engine.replay_alone(point)
    except Unsupported:
        return False
    return any(not r.result.passed for r in alone)


def locate(results: list[PointResult], engine: Alone) -> Divergence | None:
    """The first divergence of a whole-model replay's ``results``, located (None: every
    point passed)."""
    failing = first_divergence(results)
    if failing is None:
        return None
    try:
        alone = engine.replay_alone(failing.point)
    except Unsupported as exc:  # the whole model's verdict stands; only not located
        return Divergence(failing.point, "unlocated", failing.request, failing.result, str(exc))
    if any(not r.result.passed for r in alone):
        return Divergence(failing.point, "local", failing.request, failing.result)
    if failing.request != POOLED:  # a pooled lean has no one call to feed again
        inputs = engine.inputs_at_fault(failing)
        if inputs:
            return Divergence(failing.point, "input", failing.request, failing.result,
                              inputs=inputs)  # fmt: skip
    named = failing_upstream(results, failing.finished, engine)
    return Divergence(failing.point, "accumulated", failing.request, failing.result,
                      named=named)  # fmt: skip


def failing_upstream(results: list[PointResult], finished: int, engine: Alone) -> str | None:
    """The latest of the ``UPSTREAM_POINTS`` points that finished before the ``finished``-th
    result (in the order the forward called them) that fails alone on the golden inputs, its
    pooled lean included: the module whose error, within its own budget in the whole model,
    the failing point (or the logits) carries on."""
    first: dict[str, int] = {}
    for r in results:
        if r.finished < finished:
            first[r.point] = min(first.get(r.point, r.finished), r.finished)
    before = sorted(first.items(), key=lambda item: item[1])
    for point, _ in reversed(before[-UPSTREAM_POINTS:]):
        if point != OUTPUT_POINT and fails_alone(engine, point):
            return point
    return None


def locate_logits(
    results: list[PointResult],
    logits: list[LogitsResult],
    engine: Alone,
    transform: str | None,
    after_last: str,
) -> Divergence | None:
    """Where failing logits diverge when every point passed (None where no logits fail with
    values): at the model's logit transform ``transform`` (its point's name, where the set
    captured it) when it fails alone; else ``accumulated`` from a point that fails alone (its
    error, within its budget in the whole model, carried on to the logits); else ``output``,
    after the last capture point (``after_last``: what the model does there)."""
    failing = [lg for lg in logits if not lg.passed and lg.values is not None]
    if not failing:
        return None
    first = failing[0]
    assert first.values is not None
    if transform is not None and fails_alone(engine, transform):
        return Divergence(transform, "local", first.request, first.values)
    named = failing_upstream(results, len(results), engine)
    if named:
        return Divergence(OUTPUT_POINT, "accumulated", first.request, first.values, named=named)
    return Divergence(OUTPUT_POINT, "output", first.request, first.values,
                      why_unlocated=after_last)  # fmt: skip


def locate_in_step(
    first: PointResult,
    own: Observation | str,
    before: Iterable[Callable[[], Observation | str]],
    compare: Callable[[Observation], CompareResult],
) -> DecodeLocation:
    """Where decode's first failing point ``first`` errs at its step (the module docs of
    ``replay.decode_locate``): ``local`` when its ``own`` error (``compare``: against the
    point's isolated budget) is beyond budget; else ``accumulated``, naming the latest of
    the points that ran ``before`` it at the step (latest first, each observed when asked
    for) whose own error is; ``unlocated`` where the point cannot run again."""
    if isinstance(own, str):
        return DecodeLocation("unlocated", None, own)
    judged = compare(own)
    if not judged.passed:
        return DecodeLocation(
            "local", None,
            f"{first.point} errs beyond its own budget on the input it was fed at step "
            f"{first.step} (against itself in float32 on that input): {judged.reason}",
        )  # fmt: skip
    for observe in before:
        seen = observe()
        if isinstance(seen, str):
            continue
        checked = compare(seen)
        if not checked.passed:
            return DecodeLocation(
                "accumulated", seen.point,
                f"{first.point} is within its own budget on its input; {seen.point}, before "
                f"it at step {first.step}, is not: {checked.reason}",
            )  # fmt: skip
    return DecodeLocation(
        "accumulated", None,
        f"{first.point} is within its own budget on the input it was fed at step {first.step}, "
        "and so is every point before it that runs alone: the error comes from upstream "
        "(an attention, or a cache)",
    )  # fmt: skip


#: Config attributes of a transform models apply to their logits after the LM head.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def logit_transform(config: Any) -> str:
    """What the model does to its logits after the LM head, from its config (soft-capping,
    scaling), for a divergence that only the logits show."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = [
        f"{name} {value}"
        for name in LOGIT_TRANSFORMS
        if (value := getattr(text, name, None)) not in (None, 1, 1.0)
    ]
    where = f" ({', '.join(found)})" if found else " (the config names none)"
    return (
        "every capture point is within budget and the logits are not: the fault is after the "
        f"LM head, in the model's final logit transform{where}"
    )
