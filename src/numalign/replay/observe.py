"""What a replay observes of a model as it runs, eager or compiled: for an eager model the
hooks of ``replay.layer`` and ``golden.reference``; for a ``runtime.compiled_model.CompiledModel``
the outputs its tap hooks collected from inside the compiled graph, compared after the
forward in the order the calls completed (the decision is ``runtime.compiled``'s: taps, not
hooks that break the graph)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar, cast

from numalign.compare.exact import LeftOut
from numalign.golden.reference import hooks
from numalign.replay.layer import CallMatcher, golden_outputs
from numalign.replay.pipeline import Stage, stage_of
from numalign.runtime.compiled_model import CompiledModel

if TYPE_CHECKING:
    import torch

    from numalign.core.statistics import Expected
    from numalign.golden.store import GoldenSet


@contextmanager
def observe(
    model: Any,
    golden: GoldenSet,
    request: str,
    on_output: Callable[[str, str, torch.Tensor, Expected, int], None],
    on_left_out: Callable[[str, str, LeftOut, int], None] | None = None,
) -> Iterator[None]:
    """``golden_outputs`` for any model: for an eager model its hooks; for a CompiledModel
    the tensors its taps collected from inside the compiled graph, compared after the
    forward in the order the calls completed (the n-th call of a point against its n-th
    recorded call, both restricted to the positions the request's mask keeps). A pipeline
    rank's model hands on the points of its own stage alone (``replay.pipeline``)."""
    stage = stage_of(model)
    if stage is not None:
        on_output = _of_stage(stage, on_output)
        on_left_out = _of_stage(stage, on_left_out) if on_left_out is not None else None
    if not isinstance(model, CompiledModel):
        with golden_outputs(model, golden, request, on_output, on_left_out):
            yield
        return
    matcher = CallMatcher(golden, request, on_output, on_left_out)
    model.taps.clear()
    yield
    taps, model.taps[:] = list(model.taps), []
    for point, output in taps:
        matcher(point, None, None, output)


F = TypeVar("F", bound=Callable[..., None])


def _of_stage(stage: Stage, handle: F) -> F:
    """``handle(point, path, ...)`` for the outputs ``stage`` observes, nothing for others."""

    def handled(point: str, path: str, *rest: Any) -> None:
        if stage.observes(point, path):
            handle(point, path, *rest)

    return cast(F, handled)


@contextmanager
def observe_calls(
    model: Any, points: Sequence[str], on_call: Callable[[str, Any, Any, Any], None]
) -> Iterator[None]:
    """``golden.reference.hooks`` for any model: ``on_call(point, args, kwargs, output)``
    after each call of each point; for a CompiledModel, after the forward, from the outputs
    its taps collected inside the compiled graph (in the order the calls completed; args and
    kwargs are None)."""
    if not isinstance(model, CompiledModel):
        with hooks(model, points, on_call):
            yield
        return
    wanted = set(points)
    model.taps.clear()
    yield
    taps, model.taps[:] = list(model.taps), []
    for point, output in taps:
        if point in wanted:
            on_call(point, None, None, output)
