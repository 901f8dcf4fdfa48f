"""The one judge of the model suites: what an engine observed in, verdicts out.

An engine (transformers, the paged server, vLLM, a compiled model, tensor-parallel ranks)
runs the model and hands on an :class:`Observation` for each output of each call of a
capture point it computed, in each request and decode step: the tensor and the golden one it
stands beside. A :class:`Judge` holds what a verdict rests on (the set's calibration, the
replay's dtype and mode, the reduction length behind each point, the policy) and turns each
observation into a ``PointResult``, the logits into a ``LogitsResult``, and pools each
point's outputs into its lean (``compare.pooled``). Engines decide nothing: which control a
point gets, which rule an output kind goes to, what a failing KV cache state's cause is, all
live here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from numalign.compare.calibration import CACHE_POINT, OUTPUT_POINT, control_for
from numalign.compare.cause import in_cache
from numalign.compare.exact import judge_left_out
from numalign.compare.known_scale import Explained
from numalign.compare.model_verdict import (
    LogitsResult,
    PointResult,
    compare_point,
    judge_logits,
)
from numalign.compare.policy import thresholds_of
from numalign.compare.pooled import POOLED, PointLeans
from numalign.core.kernel_scale import KnownScale
from numalign.core.observation import Observation, label
from numalign.core.statistics import TensorStatistics

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from numalign.compare.calibration import Control
    from numalign.compare.result import CompareResult

#: The modes a point is judged in: alone on the golden inputs, inside the whole model, the
#: model's own outputs, and at a decode step.
MODES = ("isolated", "accumulated", "output", "decode")


class _Ordered(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def order(self) -> int: ...


class CalibratedSet(Protocol):
    """A golden set as the judge reads it: its calibration and its points in order."""

    @property
    def points(self) -> Sequence[_Ordered]: ...
    def calibrated(self, dtype: str, point: str, path: str, mode: str) -> Any: ...
    def calibrated_paths(self, dtype: str, point: str) -> list[str]: ...
    def output_kind(self, point: str, path: str) -> str: ...


@dataclass
class Judge:
    """Judges a replay's observations in one ``mode`` (``MODES``) and dtype against
    ``golden``'s calibration: ``hidden`` and ``depth`` give the reduction length behind each
    control (``control_for``), ``order`` each point's order in the set (a point it lacks
    sorts last). ``points``, ``logits`` and ``outputs`` (an encoder's final hidden states)
    collect the verdicts in the order observed;
    ``pooled`` judges the pooled leans once every observation is in (``leans``: False where
    the replay pools none). ``known``: a kernel's measured scale (``compare.known_scale``);
    ``explained`` then holds which failures it explains."""

    golden: CalibratedSet
    dtype: str
    mode: str
    hidden: int
    depth: int
    policy: Any = None
    order: dict[str, int] = field(default_factory=dict)
    leans: bool = True
    known: KnownScale | None = None
    points: list[PointResult] = field(default_factory=list)
    logits: list[LogitsResult] = field(default_factory=list)
    outputs: list[PointResult] = field(default_factory=list)
    _leans: PointLeans = field(init=False)
    _controls: dict[tuple[str, str, str], Control] = field(default_factory=dict, init=False)
    explained: Explained | None = field(default=None, init=False)
    #: the leans of the known scale's points with each of its scales taken out
    _known_leans: dict[float, PointLeans] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"no judge mode {self.mode!r}: one of {', '.join(MODES)}")
        self._leans = self._new_leans()
        if self.known is not None:
            self.explained = Explained(self.known)
            self._known_leans = {s: self._new_leans() for s in self.known.scales()}

    def _new_leans(self) -> PointLeans:
        return PointLeans(self.golden, self.dtype, self.hidden, thresholds_of(self.policy),
                          mode=self.mode)  # fmt: skip

    @classmethod
    def of_set(
        cls,
        golden: CalibratedSet,
        dtype: str,
        mode: str,
        hidden_depth: tuple[int, int],
        policy: Any = None,
        *,
        leans: bool = True,
        known: KnownScale | None = None,
    ) -> Judge:
        """The judge of a replay of ``golden`` in ``dtype`` and ``mode``, its points in the
        set's order (``hidden_depth``: the reduction length behind each control, as
        ``replay.model.hidden_and_depth`` gives it; ``leans``: whether it pools each point's
        outputs into a lean; ``known``: a kernel's measured scale)."""
        order = {p.name: p.order for p in golden.points}
        return cls(golden, dtype, mode, *hidden_depth, policy, order=order, leans=leans,
                   known=known)  # fmt: skip

    def control(self, point: str, path: str, mode: str | None = None) -> Control:
        """The control of ``point``'s output ``path`` in the judge's dtype and ``mode`` (the
        judge's own by default), computed once."""
        key = (point, path, mode or self.mode)
        if key not in self._controls:
            self._controls[key] = control_for(
                self.golden, self.dtype, point, path, key[2], self.hidden, self.depth,
                thresholds_of(self.policy),
            )  # fmt: skip
        return self._controls[key]

    def compare(self, point: str, path: str, actual: torch.Tensor,
                expected: torch.Tensor | TensorStatistics, mode: str | None = None,
                name: str | None = None) -> CompareResult:  # fmt: skip
        """One output against its control, by the rule of its kind as the set stores it
        (``compare.output_kind``), recorded nowhere (a decision's side question: whether a
        point fails alone, the budget of a later position); ``name``: the result's, the
        point's label by default."""
        control = self.control(point, path, mode)
        return compare_point(actual, expected, name or label(point, path), control, self.policy,
                             self.golden.output_kind(point, path))  # fmt: skip

    def observe(self, seen: Observation) -> PointResult | LogitsResult:
        """``seen`` judged and kept: the model's logits by the logits rule (``logits``),
        every other output by its kind's rule within its control (``points``), pooled into
        its point's lean where the judge pools them."""
        if seen.point == OUTPUT_POINT and seen.path == "logits":
            assert not isinstance(seen.expected, TensorStatistics)  # logits are kept whole
            return self.judge_logits(seen.request, seen.actual, seen.expected, step=seen.step)
        point, path = seen.control_of or (seen.point, seen.path)
        result = self.compare(point, path, seen.actual, seen.expected,
                              name=label(seen.point, seen.path))  # fmt: skip
        result = judge_left_out(result, seen.left_out)
        if seen.point == CACHE_POINT and seen.step is not None:
            # an error at some cached positions after a decode step is the cache's
            result = replace(result, cause=in_cache(result.cause, seen.path, seen.step))
        finished = len(self.points) if seen.finished is None else seen.finished
        order = self.order.get(seen.point, len(self.order))
        judged = PointResult(seen.point, order, seen.request, seen.path, result, self.mode,
                             finished=finished, step=seen.step, call=seen.call)  # fmt: skip
        self.points.append(judged)
        if not result.passed:
            self._explain(seen, point, path)
        expected = seen.expected  # a tensor, or statistics (global leans: compare.lean)
        if self.leans and seen.point not in (CACHE_POINT, OUTPUT_POINT):
            # the lean ranks where the point's first result does, in the first divergence
            self._leans.add(seen.point, seen.path, seen.actual, expected, order, judged.finished)
            if self.known is not None and seen.point in self.known.points:
                for scale, leans in self._known_leans.items():
                    undone = self.known.removed(seen.actual, scale, rounded=False)
                    leans.add(seen.point, seen.path, undone, expected, order, judged.finished)
        return judged

    def _explain(self, seen: Observation, point: str, path: str) -> None:
        """Whether the known scale explains ``seen``'s failure: judged again with each of its
        scales taken out, one passes (``compare.known_scale``)."""
        if self.explained is None:
            return
        known = self.explained.known
        name = label(seen.point, seen.path)
        if seen.point in known.points and seen.actual.is_floating_point() and not seen.left_out:
            for scale in known.scales():
                again = self.compare(point, path, known.removed(seen.actual, scale),
                                     seen.expected, name=name)  # fmt: skip
                if again.passed:
                    key = (seen.point, seen.path, seen.request, seen.step, seen.call)
                    self.explained.explained.add(key)
                    return
        self.explained.unexplained.add(f"{name} in request {seen.request}")

    def judge_logits(self, request: str, actual: torch.Tensor, expected: torch.Tensor,
                     step: int | None = None) -> LogitsResult:  # fmt: skip
        """One request's logits (at decode ``step``, or the prompt's in mode ``output``)
        against the golden ones, kept in ``logits``."""
        mode = "decode" if step is not None else "output"
        judged = judge_logits(request, actual, expected, self.control(OUTPUT_POINT, "logits", mode),
                              self.policy)  # fmt: skip
        judged.step = step
        self.logits.append(judged)
        if not judged.passed and self.explained is not None:  # no kernel scale explains logits
            self.explained.unexplained.add(f"the logits of request {request}")
        return judged

    def judge_output(self, request: str, output: str, actual: torch.Tensor,
                     expected: torch.Tensor) -> PointResult:  # fmt: skip
        """One of the model's own outputs other than logits (an encoder's hidden states)
        against its control in mode ``output``, kept in ``outputs``; it ranks after every
        point."""
        result = self.compare(OUTPUT_POINT, output, actual, expected, "output", output)
        judged = PointResult(output, len(self.order), request, "0", result, "output")
        self.outputs.append(judged)
        if not result.passed and self.explained is not None:
            self.explained.unexplained.add(f"the output {output} of request {request}")
        return judged

    def pooled(self) -> list[PointResult]:
        """Each point output's pooled lean, every observation in (none where the judge pools
        none); with a known scale, which failing leans it explains (``explained``)."""
        results = self._leans.results() if self.leans else []
        if self.explained is not None:
            undone = [{(r.point, r.path): r for r in leans.results()}
                      for leans in self._known_leans.values()]  # fmt: skip
            for r in results:
                if r.result.passed:
                    continue
                again = [u.get((r.point, r.path)) for u in undone]
                if any(a is not None and a.result.passed for a in again):
                    self.explained.explained.add((r.point, r.path, POOLED, None, 0))
                else:
                    self.explained.unexplained.add(f"{label(r.point, r.path)}'s pooled lean")
        return results
