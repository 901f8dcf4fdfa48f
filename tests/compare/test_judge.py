"""The one judge (``compare.judge``) and the location rule (``compare.locate``), on a
calibration written by hand: what engines hand on becomes the same verdicts whichever engine
observed it."""

from __future__ import annotations

import pytest
import torch

from numalign.compare.calibration import CACHE_POINT, OUTPUT_POINT, ControlStats
from numalign.compare.judge import Judge
from numalign.compare.locate import UPSTREAM_POINTS, locate, locate_logits
from numalign.compare.model_verdict import PointResult
from numalign.compare.output_kind import TENSOR
from numalign.compare.pooled import POOLED
from numalign.core.errors import Unsupported
from numalign.core.observation import Observation

#: the control's errors: every point errs by at most 1e-3 (max abs) and 1e-3 relative L2 in
#: bfloat16; an error 0.1 in every element leaves them by 100x, whatever the rule
BUDGET = ControlStats(max_abs=1e-3, rel_l2=1e-3, cosine=1.0 - 1e-6, norm_ratio=1.0)


class Golden:
    """A calibration of every point's output "0" (the set's ``norm``, ``attn``, ``mlp``
    among them), the cache and the model's logits, alike in every mode; no point has an
    output "residual" of its own."""

    points = ("norm", "attn", "mlp")

    def calibrated(self, dtype: str, point: str, path: str, mode: str) -> ControlStats | None:
        if point == OUTPUT_POINT:
            return ControlStats(max_abs=1e-3, rel_l2=1e-3, kl_max=1e-6)
        return BUDGET if point == CACHE_POINT or path == "0" else None

    def calibrated_paths(self, dtype: str, point: str) -> list[str]:
        return ["0"]

    def output_kind(self, point: str, path: str) -> str:
        return TENSOR


def judge(mode: str = "accumulated") -> Judge:
    order = {p: i for i, p in enumerate(Golden.points)}
    return Judge(Golden(), "bfloat16", mode, 64, 2, order=order, leans=False)


def truth(shape: tuple[int, ...] = (4, 64)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def seen(point: str, error: float = 0.0, **kwargs: object) -> Observation:
    expected = truth()
    return Observation(point, "0", "r0", (expected + error).to(torch.bfloat16), expected,
                       **kwargs)  # type: ignore[arg-type]  # fmt: skip


def test_each_observation_becomes_a_point_result_in_order_with_its_points_order() -> None:
    j = judge()
    first = j.observe(seen("mlp"))
    second = j.observe(seen("norm", 0.1))
    assert isinstance(first, PointResult) and isinstance(second, PointResult)
    assert [r.point for r in j.points] == ["mlp", "norm"]
    assert (first.order, second.order) == (2, 0)
    assert (first.finished, second.finished) == (0, 1)  # the judge's own count
    assert first.result.passed and not second.result.passed
    assert second.mode == "accumulated"


def test_an_engines_own_completion_order_is_kept() -> None:
    j = judge()
    assert j.observe(seen("attn", finished=7)).finished == 7


def test_an_output_with_no_control_of_its_own_is_judged_by_the_one_it_names() -> None:
    """A fused add + norm's residual stream borrows the block's control, under its own name."""
    j = judge()
    expected = truth()
    residual = Observation("attn", "residual", "r0", expected.to(torch.bfloat16), expected,
                           control_of=("attn", "0"))  # fmt: skip
    judged = j.observe(residual)
    assert isinstance(judged, PointResult)
    assert judged.result.name == "attn.residual" and judged.result.passed
    with pytest.raises(Exception, match="no calibration"):  # without it: uncalibrated
        j.observe(Observation("attn", "residual", "r0", expected.to(torch.bfloat16), expected))


def test_logits_go_to_the_logits_rule_with_their_step() -> None:
    j = judge("decode")
    expected = truth((3, 50))
    judged = j.observe(Observation(OUTPUT_POINT, "logits", "r0", expected.to(torch.bfloat16),
                                   expected, step=2))  # fmt: skip
    assert j.logits == [judged] and not j.points
    assert judged.step == 2 and judged.passed


def test_a_cache_error_at_some_positions_after_a_decode_step_is_the_caches() -> None:
    """The same error reads ``cache`` after step 1 and keeps its signature's label at step 0
    (the prefill's cache holds the prompt's positions: a mask's)."""
    expected = truth((16, 64))
    actual = expected.clone()
    actual[5] += 1.0  # one cached position wrong
    causes = {}
    for step in (0, 1):
        j = judge("decode")
        judged = j.observe(Observation(CACHE_POINT, "layers.0.keys", "r0",
                                       actual.to(torch.bfloat16), expected, step=step))  # fmt: skip
        assert isinstance(judged, PointResult) and not judged.result.passed
        assert judged.result.cause is not None
        causes[step] = judged.result.cause.label
    assert causes[1] == "cache" and causes[0] != "cache"


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="no judge mode 'layer'"):
        Judge(Golden(), "bfloat16", "layer", 64, 2)


# -- the location rule -------------------------------------------------------------------------


class Engine:
    """An engine whose points fail alone as told; ``inputs``: what ``inputs_at_fault``
    answers."""

    def __init__(self, failing_alone: set[str], *, unsupported: str | None = None,
                 inputs: tuple[tuple[str, str], ...] | None = None) -> None:  # fmt: skip
        self.failing_alone = failing_alone
        self.unsupported = unsupported
        self.inputs = inputs
        self.asked: list[str] = []

    def replay_alone(self, point: str) -> list[PointResult]:
        self.asked.append(point)
        if self.unsupported is not None:
            raise Unsupported(self.unsupported)
        j = judge("isolated")
        return [j.observe(seen(point, 0.1 if point in self.failing_alone else 0.0))]  # type: ignore[list-item]

    def inputs_at_fault(self, failing: PointResult) -> tuple[tuple[str, str], ...] | None:
        return self.inputs


def whole_model(failing: dict[str, bool]) -> list[PointResult]:
    j = judge()
    for point, fails in failing.items():
        j.observe(seen(point, 0.1 if fails else 0.0))
    return j.points


def test_every_point_passing_has_no_divergence_and_replays_nothing() -> None:
    engine = Engine(set())
    assert locate(whole_model({"norm": False, "attn": False}), engine) is None
    assert engine.asked == []


def test_a_point_failing_alone_is_local() -> None:
    found = locate(whole_model({"norm": False, "attn": True, "mlp": True}), Engine({"attn"}))
    assert found is not None and (found.point, found.kind) == ("attn", "local")


def test_a_point_passing_alone_fed_a_faulty_model_input_is_input() -> None:
    engine = Engine(set(), inputs=(("attention_mask", "differs at 3 entries"),))
    found = locate(whole_model({"norm": False, "attn": True}), engine)
    assert found is not None and found.kind == "input"
    assert found.inputs == (("attention_mask", "differs at 3 entries"),)


def test_an_accumulated_divergence_names_the_point_before_it_that_fails_alone() -> None:
    """``norm`` passes in the whole model but fails alone: its error is what ``attn``
    carries on."""
    engine = Engine({"norm"})
    found = locate(whole_model({"norm": False, "attn": True}), engine)
    assert found is not None and (found.kind, found.named) == ("accumulated", "norm")


def test_an_engine_that_cannot_take_the_models_inputs_still_locates() -> None:
    """vLLM answers ``inputs_at_fault`` with None: accumulated, nothing named."""
    found = locate(whole_model({"norm": False, "attn": True}), Engine(set(), inputs=None))
    assert found is not None and (found.kind, found.named) == ("accumulated", None)


def test_a_point_that_cannot_run_alone_is_unlocated_with_the_reason() -> None:
    engine = Engine(set(), unsupported="needs the forward context")
    found = locate(whole_model({"attn": True}), engine)
    assert found is not None and found.kind == "unlocated"
    assert found.why_unlocated == "needs the forward context"


def test_a_pooled_lean_asks_for_no_input_at_fault() -> None:
    j = judge()
    j.observe(seen("norm"))
    failing = j.observe(seen("attn", 0.1))
    assert isinstance(failing, PointResult)
    pooled = [PointResult("attn", 1, POOLED, "0", failing.result, finished=1), j.points[0]]
    engine = Engine(set(), inputs=(("attention_mask", "differs"),))
    found = locate(pooled, engine)
    assert found is not None and found.kind == "accumulated"


def test_only_the_points_a_block_before_are_replayed_to_name_one() -> None:
    """Of 20 points before the failing one, the latest ``UPSTREAM_POINTS`` are asked."""
    j = judge()
    for i in range(20):
        j.order[f"p{i}"] = i
        j.observe(seen(f"p{i}"))
    j.observe(seen("last", 0.1))
    engine = Engine({"p0"})  # fails alone, but too far up to be named
    found = locate(j.points, engine)
    assert found is not None and found.named is None
    assert engine.asked[1:] == [f"p{i}" for i in range(19, 19 - UPSTREAM_POINTS, -1)]


def test_failing_logits_with_every_point_passing_are_located_after_the_points() -> None:
    j = judge()
    j.observe(seen("norm"))
    expected = truth((3, 50))
    j.judge_logits("r0", (expected + 0.5).to(torch.bfloat16), expected)
    at_transform = locate_logits(j.points, j.logits, Engine({"softcap"}), "softcap", "after")
    assert at_transform is not None and (at_transform.point, at_transform.kind) == (
        "softcap", "local")  # fmt: skip
    upstream = locate_logits(j.points, j.logits, Engine({"norm"}), None, "after")
    assert upstream is not None and (upstream.kind, upstream.named) == ("accumulated", "norm")
    output = locate_logits(j.points, j.logits, Engine(set()), None, "a final soft-cap")
    assert output is not None and output.kind == "output"
    assert output.why_unlocated == "a final soft-cap"
