"""The one judge of a replay (``compare.model_judge``), on a calibration written by hand: an
engine hands it observations and gets the mode's verdict, its continuation and its first
divergence located, whichever engine it is."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from numalign.compare.calibration import OUTPUT_POINT, ControlStats
from numalign.compare.locate import locate_in_step
from numalign.compare.logits import near_tie
from numalign.compare.model_judge import ModelJudge
from numalign.compare.model_verdict import PointResult
from numalign.compare.output_kind import TENSOR
from numalign.core.errors import Unsupported
from numalign.core.observation import ContinuationRun, FinalOutput, Observation

#: every point errs by at most 1e-3 (max abs, relative L2) in bfloat16: an error of 0.1 in
#: every element leaves the budget a hundredfold, whatever the rule
BUDGET = ControlStats(max_abs=1e-3, rel_l2=1e-3, cosine=1.0 - 1e-6, norm_ratio=1.0)
VOCAB = 32


@dataclass(frozen=True)
class Point:
    name: str
    order: int


class Golden:
    """Every point's output "0" calibrated alike in every mode, and the logits."""

    points = (Point("norm", 0), Point("attn", 1), Point("mlp", 2))

    def calibrated(self, dtype: str, point: str, path: str, mode: str) -> ControlStats | None:
        if point == OUTPUT_POINT:
            return ControlStats(max_abs=0.05, rel_l2=1e-2, kl_max=1e-4)
        return BUDGET if path == "0" else None

    def calibrated_paths(self, dtype: str, point: str) -> list[str]:
        return ["0"]

    def output_kind(self, point: str, path: str) -> str:
        return TENSOR


def judge(mode: str = "accumulated") -> ModelJudge:
    return ModelJudge(Golden(), "bfloat16", mode, (64, 2), leans=False)


def truth(shape: tuple[int, ...] = (4, 64), seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def seen(point: str, error: float = 0.0, **kwargs: object) -> Observation:
    expected = truth()
    return Observation(point, "0", "r0", (expected + error).to(torch.bfloat16), expected,
                       **kwargs)  # fmt: skip


@dataclass
class Engine:
    """Points run alone with the error each has alone (none where not named); a point in
    ``cannot`` cannot run alone."""

    alone_errors: dict[str, float]
    cannot: tuple[str, ...] = ()
    asked: list[str] | None = None

    def observe_alone(self, point: str, see: Callable[[Observation], None]) -> None:
        if self.asked is not None:
            self.asked.append(point)
        if point in self.cannot:
            raise Unsupported(f"{point} needs the forward context")
        see(seen(point, self.alone_errors.get(point, 0.0), finished=0))

    def inputs_at_fault(self, failing: PointResult, compare: object) -> None:
        return None


def test_the_whole_models_verdict_locates_a_point_failing_alone_as_local() -> None:
    j = judge()
    for name in ("norm", "attn", "mlp"):
        j.see(seen(name, 0.1 if name == "attn" else 0.0))
    verdict = j.model_verdict(Engine({"attn": 0.1}))
    assert not verdict.passed
    assert verdict.divergence is not None
    assert (verdict.divergence.point, verdict.divergence.kind) == ("attn", "local")


def test_an_error_passing_alone_is_accumulated_from_the_point_before_that_fails_alone() -> None:
    j = judge()
    for name in ("norm", "attn", "mlp"):
        j.see(seen(name, 0.0 if name == "norm" else 0.1))
    asked: list[str] = []
    verdict = j.model_verdict(Engine({"norm": 0.0}, cannot=("mlp",), asked=asked))
    assert verdict.divergence is not None
    # attn passes alone (the engine observes it without error): the error came with its input
    assert verdict.divergence.kind == "accumulated" and verdict.divergence.point == "attn"
    assert asked[0] == "attn"  # the judge asked the engine to run the failing point alone


def test_a_point_that_cannot_run_alone_is_unlocated_with_the_engines_reason() -> None:
    j = judge()
    j.see(seen("attn", 0.1))
    verdict = j.model_verdict(Engine({}, cannot=("attn",)))
    assert verdict.divergence is not None and verdict.divergence.kind == "unlocated"
    assert "forward context" in (verdict.divergence.why_unlocated or "")


def test_failing_logits_with_every_point_passing_name_the_models_logit_transform() -> None:
    j = judge()
    j.see(seen("norm"))
    expected = truth((1, 3, VOCAB))
    j.see(FinalOutput("r0", "logits", (expected + 5.0 * expected.sign()).float(), expected))
    config = type("Config", (), {"final_logit_softcapping": 30.0})()
    verdict = j.model_verdict(Engine({}), transform="logit_transform", config=config)
    assert verdict.divergence is not None and verdict.divergence.kind == "output"
    assert "final_logit_softcapping 30.0" in (verdict.divergence.why_unlocated or "")


def continuation(gap: float, calls: list[int]) -> ContinuationRun:
    """A 4-step continuation whose golden token at each step leads the runner-up by ``gap``
    (golden logits 10 and 10 - gap); the engine's steps pick the runner-up at step 2."""
    logits = torch.zeros(1, 4, VOCAB, dtype=torch.float64)
    logits[0, :, 0], logits[0, :, 1] = 10.0, 10.0 - gap
    tokens = logits.argmax(-1)

    def steps() -> Iterator[torch.Tensor]:
        calls.append(1)
        for step in range(4):
            mine = logits[:, step].clone()
            if step == 2:
                mine[0, 1] = 11.0
            yield mine

    return ContinuationRun("r0", tokens, logits, steps)


#: golden gaps far within and far beyond the near tie of any budget the 0.05 max-abs logits
#: control gives (near_tie is a small multiple of it: asserted below)
TIE, DECISIVE = 1e-4, 100.0


def test_a_greedy_flip_within_the_logits_near_tie_passes_and_beyond_it_fails() -> None:
    prompt = truth((1, 3, VOCAB))
    calls: list[int] = []
    passed = {}
    for gap in (TIE, DECISIVE):
        j = judge()
        j.see(FinalOutput("r0", "logits", prompt.float(), prompt))
        values = j.judge.logits[0].values
        assert values is not None and TIE < near_tie(values.budget["max_abs"]) < DECISIVE
        j.see(continuation(gap, calls))
        (result,) = j.continuation
        assert result.first_divergence == 2 and result.steps == 4
        passed[gap] = result.passed
    assert passed == {TIE: True, DECISIVE: False}
    assert calls == [1, 1]  # each continuation ran once


def test_a_continuation_is_not_run_where_the_prompts_logits_give_no_budget() -> None:
    j = judge()
    calls: list[int] = []
    j.see(continuation(TIE, calls))  # no logits were judged for the request
    assert j.continuation == [] and calls == []


@dataclass
class Reversed:
    """Ranks that hand back every result in reverse and wrap the alone replays."""

    wrapped: list[object]

    def merged(
        self, points: list[PointResult], pooled: list[PointResult]
    ) -> tuple[list[PointResult], list[PointResult]]:
        return points[::-1], pooled

    def alone(self, inner: object) -> object:
        self.wrapped.append(inner)
        return inner


def test_ranks_merge_the_results_before_the_divergence_is_located() -> None:
    j = judge()
    j.see(seen("mlp", 0.1, finished=1))
    j.see(seen("norm", 0.1, finished=0))
    ranks = Reversed([])
    verdict = j.model_verdict(Engine({"norm": 0.1, "mlp": 0.1}), ranks=ranks)
    assert [r.point for r in verdict.points] == ["norm", "mlp"]
    assert len(ranks.wrapped) == 1
    assert verdict.divergence is not None and verdict.divergence.point == "norm"


def test_the_decode_verdict_keeps_each_steps_logits_and_the_engines_unmapped_points() -> None:
    j = judge("decode")
    j.see(seen("mlp", step=1))
    logits = truth((1, VOCAB))
    j.see(Observation(OUTPUT_POINT, "logits", "r0", logits.float(), logits, step=1))
    verdict = j.decode_verdict("paged", unmapped={"attn": "no counterpart"})
    assert verdict.passed and [r.point for r in verdict.points] == ["mlp"]
    assert [lg.step for lg in verdict.logits] == [1]
    assert verdict.unmapped == {"attn": "no counterpart"}


def test_a_decode_step_locates_its_own_error_then_the_latest_point_before_it() -> None:
    j = judge("isolated").judge

    def compare(o: Observation) -> object:
        return j.compare(o.point, o.path, o.actual, o.expected)

    first = PointResult("mlp", 2, "r0", "0", j.compare("mlp", "0", *pair(0.1)), step=3)
    asked: list[str] = []

    def before(name: str, error: float) -> Callable[[], Observation]:
        return lambda: asked.append(name) or seen(name, error)

    local = locate_in_step(first, seen("mlp", 0.1), [before("attn", 0.1)], compare)
    assert local.kind == "local" and asked == []  # nothing before it is run again
    named = locate_in_step(first, seen("mlp"), [before("attn", 0.0), before("norm", 0.1)],
                           compare)  # fmt: skip
    assert (named.kind, named.named) == ("accumulated", "norm") and asked == ["attn", "norm"]
    assert locate_in_step(first, "mlp takes the KV cache", [], compare).kind == "unlocated"
    upstream = locate_in_step(first, seen("mlp"), [lambda: "norm takes the KV cache"], compare)
    assert (upstream.kind, upstream.named) == ("accumulated", None)


def pair(error: float) -> tuple[torch.Tensor, torch.Tensor]:
    expected = truth()
    return (expected + error).to(torch.bfloat16), expected
