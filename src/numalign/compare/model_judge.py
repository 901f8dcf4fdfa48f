"""The one judge of a replay, for every engine and mode: observations in, a verdict out.

An engine (transformers, its paged server, vLLM, a compiled model, a rank of a group) runs
the model and hands each thing it computed to ``ModelJudge.see`` as it goes: an
``Observation`` (one output of one call of a capture point, in a request and decode step), a
``FinalOutput`` (the model's own logits, or an encoder's hidden states), a
``ContinuationRun`` (how to run the greedy continuation, teacher-forced; the three in
``core.observation``). The judge holds
the golden set, the dtype, the mode and the policy; it decides every result, pools the
leans, judges the continuation against its near tie, and at the end gives the verdict of the
mode: a layer's results (``layer_results``), the whole model's with its first divergence
located (``model_verdict``), the decode's (``decode_verdict``). To locate a divergence the
engine offers an :class:`AloneObserver` (its points run alone on the golden inputs, observed
the same way) and, where its ranks each judged a share of the model, :class:`Ranks`.

An engine imports nothing of ``compare`` (``replay.judging`` hands its observations here):
which control a point gets, which rule an output kind goes to, when a continuation's flip is
a near tie, where a divergence lives, all live here and below.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from numalign.compare.calibration import OUTPUT_POINT
from numalign.compare.decode_verdict import DecodeVerdict
from numalign.compare.judge import CalibratedSet, Judge
from numalign.compare.locate import Alone, locate, locate_logits, logit_transform
from numalign.compare.logits import near_tie
from numalign.compare.model_verdict import ContinuationResult, ModelVerdict, PointResult
from numalign.compare.policy import thresholds_of
from numalign.core import dtypes
from numalign.core.kernel_scale import KnownScale
from numalign.core.observation import ContinuationRun, Event, FinalOutput, Observation

if TYPE_CHECKING:
    import torch

    from numalign.compare.result import CompareResult
    from numalign.compare.tolerances import Thresholds


class AloneObserver(Protocol):
    """What an engine offers to locate a divergence: its points run alone on the golden
    inputs, observed like the whole model."""

    def observe_alone(self, point: str, see: Callable[[Observation], None]) -> None:
        """Every recorded call of ``point`` run alone on its golden inputs, each output
        handed to ``see``; ``numalign.core.errors.Unsupported`` saying why where the point
        cannot run alone (or the set has no such point)."""
        ...

    def inputs_at_fault(
        self,
        failing: PointResult,
        compare: Callable[[str, torch.Tensor, torch.Tensor], CompareResult],
    ) -> tuple[tuple[str, str], ...] | None:
        """The model's own keyword inputs of ``failing``'s call that make it fail alone
        (``compare(path, actual, expected)`` judges one of its outputs alone), each with how
        it differs from the golden one; None where the engine cannot take them."""
        ...


class Ranks(Protocol):
    """Ranks that each judged their share of the model (pipeline stages): every rank's
    results in the order one process judges them, and its points replayed alone on the rank
    that holds them."""

    def merged(
        self, points: list[PointResult], pooled: list[PointResult]
    ) -> tuple[list[PointResult], list[PointResult]]: ...

    def alone(self, inner: Alone) -> Alone: ...


@dataclass
class ModelJudge:
    """The judge of one replay of ``golden`` in ``dtype`` and ``mode`` (``judge.MODES``):
    ``hidden_depth`` the reduction length behind each control (``replay.model.
    hidden_and_depth``); ``leans``: whether each point's outputs pool into a lean (an engine
    whose honest kernels were never measured against the leans pools none)."""

    golden: CalibratedSet
    dtype: str
    mode: str
    hidden_depth: tuple[int, int]
    policy: Any = None
    leans: bool = True
    known: KnownScale | None = None
    continuation: list[ContinuationResult] = field(default_factory=list)
    judge: Judge = field(init=False)
    #: each request's logits max-abs budget, which the continuation's near tie rests on
    _logits_budget: dict[str, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.judge = Judge.of_set(self.golden, self.dtype, self.mode, self.hidden_depth,
                                  self.policy, leans=self.leans, known=self.known)  # fmt: skip

    def another(self, mode: str) -> ModelJudge:
        """A fresh judge of the same replay in ``mode`` (a point replayed alone: isolated)."""
        return ModelJudge(self.golden, self.dtype, mode, self.hidden_depth, self.policy)

    def see(self, event: Event) -> None:
        """``event`` judged and kept (the module doc)."""
        if isinstance(event, Observation):
            self.judge.observe(event)
        elif isinstance(event, FinalOutput):
            self._final(event)
        else:
            self._continuation(event)

    def _final(self, seen: FinalOutput) -> None:
        if seen.output != "logits":
            self.judge.judge_output(seen.request, seen.output, seen.actual, seen.expected)
            return
        judged = self.judge.judge_logits(seen.request, seen.actual, seen.expected)
        budget = judged.values.budget.get("max_abs", 0.0) if judged.values else 0.0
        self._logits_budget[seen.request] = budget

    def _continuation(self, seen: ContinuationRun) -> None:
        budget = self._logits_budget.get(seen.request, 0.0)
        if budget <= 0:  # no budget the continuation's near tie could rest on
            return
        self.continuation.append(continuation_agreement(
            seen.request, seen.steps(), seen.tokens, seen.logits, budget,
            self._later_positions_budget, thresholds_of(self.policy),
        ))  # fmt: skip

    def _later_positions_budget(self, actual: torch.Tensor, expected: torch.Tensor) -> float:
        """The max-abs budget of logits at a position after the prompt, from the set's decode
        calibration (0 where it has none)."""
        if not self.judge.control(OUTPUT_POINT, "logits", "decode").calibrated:
            return 0.0
        actual = actual.to(dtypes.torch_dtype(self.dtype))
        result = self.judge.compare(OUTPUT_POINT, "logits", actual, expected, "decode", "logits")
        return float(result.budget.get("max_abs", 0.0))

    # -- the verdicts ------------------------------------------------------------------

    def known_failure(self) -> str | None:
        """Why the verdict's failures are expected: every one explained by the known scale
        (its evidence; ``compare.known_scale``), asked once the verdict is built; None where
        there is no known scale, nothing failed, or a failure is not the kernel's (a greedy
        continuation that departs is never one)."""
        explained = self.judge.explained
        if explained is None or any(not c.passed for c in self.continuation):
            return None
        return explained.reason()

    def layer_results(self) -> list[PointResult]:
        """Every result, then each point output's pooled lean."""
        return self.judge.points + self.judge.pooled()

    def model_verdict(
        self,
        alone: AloneObserver,
        *,
        transform: str | None = None,
        config: Any = None,
        ranks: Ranks | None = None,
        unmapped: dict[str, str] | None = None,
    ) -> ModelVerdict:
        """The whole model's verdict: every point, its pooled leans, the logits and other
        outputs, the continuation, and the first divergence located with ``alone`` (where
        only the logits fail: at the logit ``transform`` point, named from the model's
        ``config``); ``unmapped``: points the engine has no counterpart for."""
        points, pooled = self.judge.points, self.judge.pooled()
        located: Alone = JudgedAlone(alone, self)
        if ranks is not None:
            points, pooled = ranks.merged(points, pooled)
            located = ranks.alone(located)
        results = points + pooled
        divergence = locate(results, located) or locate_logits(
            results, self.judge.logits, located, transform, logit_transform(config)
        )
        return ModelVerdict(points=results, logits=self.judge.logits,
                            continuation=self.continuation, outputs=self.judge.outputs,
                            divergence=divergence, unmapped=dict(unmapped or {}))  # fmt: skip

    def decode_verdict(
        self, cache: str, *, ranks: Ranks | None = None, unmapped: dict[str, str] | None = None
    ) -> DecodeVerdict:
        """The decode's verdict with KV cache ``cache``: every step's points and cache
        states, their pooled leans, every step's logits (the first divergence is the
        verdict's to find)."""
        points, pooled = self.judge.points, self.judge.pooled()
        if ranks is not None:
            points, pooled = ranks.merged(points, pooled)
        return DecodeVerdict(cache, points=points + pooled, logits=self.judge.logits,
                             unmapped=dict(unmapped or {}))  # fmt: skip


@dataclass
class JudgedAlone:
    """An engine's points run alone, judged in mode ``isolated`` by ``owner``'s replay: the
    ``compare.locate.Alone`` the first divergence is located with."""

    engine: AloneObserver
    owner: ModelJudge

    def replay_alone(self, point: str) -> list[PointResult]:
        judge = self.owner.another("isolated")
        self.engine.observe_alone(point, judge.see)
        return judge.layer_results()

    def inputs_at_fault(self, failing: PointResult) -> tuple[tuple[str, str], ...] | None:
        judge = self.owner.another("isolated").judge

        def compare(path: str, actual: torch.Tensor, expected: torch.Tensor) -> CompareResult:
            return judge.compare(failing.point, path, actual, expected)

        return self.engine.inputs_at_fault(failing, compare)

    def feed(self, failing: PointResult) -> None:
        """The engine's forward that feeds ``failing``'s point its inputs, run for its own
        sake (a pipeline rank's share of it), where the engine has one."""
        feed = getattr(self.engine, "feed", None)
        if feed is not None:
            feed(failing)


def continuation_agreement(
    request: str,
    steps: Iterable[torch.Tensor],
    tokens: torch.Tensor,
    golden_logits: torch.Tensor,
    logits_budget: float,
    later_budget: Callable[[torch.Tensor, torch.Tensor], float] | None = None,
    thresholds: Thresholds | None = None,
) -> ContinuationResult:
    """Greedy tokens of the replay (the argmax of each of ``steps``' logits) against the
    golden continuation ``tokens``: identical up to the first divergence, and there the two
    tokens' ``golden_logits`` at most a near tie apart (``logits.near_tie``: twice the
    logits' max-abs budget, each may move by it). The budget is the larger of the prompt's
    (``logits_budget``) and, at the differing step, ``later_budget(its logits, the golden
    ones)``: the calibrated budget of positions after the prompt (the set's decode
    calibration), since a step's logits sit at a position the prompt's calibration never saw
    (bfloat16 may err there an order of magnitude more: docs/sweep.md)."""
    import torch

    golden = golden_logits.double()
    first, gap = None, 0.0
    for step, logits in enumerate(steps):
        if first is not None:  # every step still runs: ranks of a group step together
            continue
        logits = logits.double().cpu()
        mine = logits.argmax(-1)
        if not torch.equal(mine, tokens[:, step]):
            first = step
            theirs = golden[:, step]
            gaps = theirs.gather(-1, tokens[:, step, None]) - theirs.gather(-1, mine[:, None])
            gap = float(gaps.max())
            if later_budget is not None:
                logits_budget = max(logits_budget, later_budget(logits, theirs.float()))
    return ContinuationResult(
        request, int(tokens.shape[1]), first, gap, near_tie(logits_budget, thresholds)
    )
