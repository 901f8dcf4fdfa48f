"""Power (``compare.power``, issue 43): the smallest scale and bias each verdict states it
would have caught are caught at twice that size and pass at half of it, on synthetic outputs
judged against a control run now and on the zoo's points replayed honestly and judged
against their calibration."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from numalign.compare import CompareResult, CompareSpec, compare
from numalign.compare.budgets import ControlBudget
from numalign.compare.calibration import control_for
from numalign.compare.model_verdict import compare_point
from numalign.compare.power import Detectable, detectable

SETS = Path(__file__).resolve().parents[2] / "golden" / "sets"
#: Twice the stated figure must fail and half of it pass: the factor of two either way is
#: the margin the honest noise the figure leaves out (a few tenths of each budget) needs.
CAUGHT, PASSED = 2.0, 0.5
#: The zoo points judged: a norm (a scale's usual home), a block's attention and MLP, and
#: the last norm, of tiny-llama (hidden 64: a point of a request is a few thousand values).
ZOO_POINTS = (
    "model.layers.0.input_layernorm",
    "model.layers.0.self_attn",
    "model.layers.1.mlp",
    "model.norm",
)


def _planted(
    honest: torch.Tensor, truth: torch.Tensor, kind: str, size: float, dtype: torch.dtype
) -> torch.Tensor:
    """``honest`` (before its last rounding, where a kernel makes its error) with a planted
    scale (``size`` times the truth) or bias (``size`` times the truth's RMS), rounded to
    ``dtype``."""
    e = truth.to(torch.float64)
    error = size * e if kind == "scale" else size * e.pow(2).mean().sqrt() * torch.ones_like(e)
    return (honest.to(torch.float64) + error).to(dtype)


def _figure(found: Detectable, kind: str) -> float:
    value: float = found.scale if kind == "scale" else found.bias
    return value


# -- synthetic: a control run now (the operator suite's judge) --------------------------------
#: A matmul's output rounded to the dtype: the control is the truth rounded once, the
#: candidate another rounding of the same (an honest kernel), over a reduction of 256.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["scale", "bias"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["up", "down"])
def test_a_planted_error_is_caught_at_twice_the_stated_figure_and_passes_at_half(
    dtype: torch.dtype, kind: str, sign: float
) -> None:
    g = torch.Generator().manual_seed(43)
    truth = torch.randn(64, 256, generator=g, dtype=torch.float64) + 0.3  # a mean: m != 0
    control = truth.to(dtype)
    # an honest kernel: the truth with an unbiased error of a quarter of the dtype's eps
    # before its last rounding (it rounds elsewhere than the control, as other orders do)
    eps = torch.finfo(dtype).eps
    noise = 0.25 * eps * truth * torch.randn(truth.shape, generator=g, dtype=torch.float64)
    honest = truth + noise

    def judge(actual: torch.Tensor) -> CompareResult:
        return compare(
            actual, truth, CompareSpec(control=control, op_class="matmul", reduction_length=256)
        )

    result = judge(honest.to(dtype))
    assert result.passed and result.detectable is not None
    figure = _figure(result.detectable, kind)
    assert 0 < figure < 0.1  # a figure that says something: less than a 10% error
    assert not judge(_planted(honest, truth, kind, sign * CAUGHT * figure, dtype)).passed
    assert judge(_planted(honest, truth, kind, sign * PASSED * figure, dtype)).passed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["scale", "bias"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["up", "down"])
def test_without_a_control_the_tolerance_table_states_its_figure(
    dtype: torch.dtype, kind: str, sign: float
) -> None:
    """No control: the (dtype, class) table's rtol and atol, and the distribution rule's
    thresholds relaxed by the truth rounded to the dtype, give the figure."""
    truth = torch.randn(32, 128, generator=torch.Generator().manual_seed(1),
                        dtype=torch.float64) + 0.2  # fmt: skip
    result = compare(truth.to(dtype), truth)
    assert result.passed and result.rule == "tolerance" and result.detectable is not None
    figure = _figure(result.detectable, kind)
    assert not compare(_planted(truth, truth, kind, sign * CAUGHT * figure, dtype), truth).passed
    assert compare(_planted(truth, truth, kind, sign * PASSED * figure, dtype), truth).passed


def test_the_systematic_scale_rule_sets_the_scale_against_a_control() -> None:
    """In bfloat16 the budget's per-element limits sit at a rounding (0.8% apart); the
    systematic scale resolves a quarter of a unit roundoff over 16,384 elements
    (``SCALE_OUTPUT_ROUNDOFFS``), which is what the figure states."""
    truth = torch.randn(64, 256, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    result = compare(truth.to(torch.bfloat16), truth, CompareSpec(control=truth.to(torch.bfloat16)))
    assert result.detectable is not None
    # a quarter of bfloat16's unit roundoff 2**-8 (SCALE_OUTPUT_ROUNDOFFS), plus the
    # control's own lean (a few per cent of it over 16,384 unbiased roundings)
    assert result.detectable.scale == pytest.approx(0.25 * 2.0**-8, rel=0.05)
    assert result.detectable.scale < result.budget["rel_l2"] / 10


def test_each_rule_figure_is_its_limit() -> None:
    """The budget's figures alone: max abs over the truth's largest magnitude and its RMS,
    the relative L2 limit for both, whichever is smaller."""
    truth = torch.tensor([3.0, -4.0, 0.0, 0.0], dtype=torch.float64)  # max 4, rms 2.5
    budget = ControlBudget(max_abs=0.5, max_abs_multiplier=4.0, control_max_abs=0.1,
                           control_tail=0.1, floor=0.1, accumulation=0.0, rel_l2=0.4,
                           rel_l2_multiplier=3.0, control_rel_l2=0.1, eps=0.1,
                           accumulation_rel=0.0)  # fmt: skip
    found = detectable(truth, budget)
    assert found == Detectable(scale=0.5 / 4.0, bias=min(0.5 / 2.5, 0.4))
    assert detectable(torch.zeros(4), budget) == Detectable(math.inf, math.inf)


def test_exact_outputs_state_no_power() -> None:
    ints = torch.arange(8)
    assert compare(ints, ints).detectable is None


# -- the zoo: honest replays judged against the calibration -----------------------------------
@pytest.fixture(scope="module")
def llama() -> tuple[object, object]:
    from numalign.golden.reference import load_model
    from numalign.golden.store import GoldenSet

    torch.set_num_threads(1)
    golden = GoldenSet.open(SETS / "tiny-llama")
    model = load_model(golden.model_dir, "bfloat16", attn_implementation="eager",
                       trust_remote_code=False)  # fmt: skip
    return golden, model


@pytest.mark.parametrize("point", ZOO_POINTS)
@pytest.mark.parametrize("kind", ["scale", "bias"])
def test_zoo_points_catch_twice_the_stated_figure_and_pass_half(
    llama: tuple[object, object], point: str, kind: str
) -> None:
    """Each call of the point replayed alone in bfloat16 (its honest noise), judged within
    the set's isolated calibration; the error planted on the honest output at twice the
    figure its own verdict states fails, at half it passes, either sign."""
    from numalign.replay.layer import replay_call
    from numalign.replay.model import hidden_and_depth

    golden, model = llama
    hidden, depth = hidden_and_depth(model)
    module = model.get_submodule(point)  # type: ignore[attr-defined]
    p = golden.point(point)  # type: ignore[attr-defined]
    judged = 0
    for calls in p.calls.values():
        for call in calls:
            outputs = replay_call(module, golden, call, device="cpu", dtype=torch.bfloat16)
            honest, truth = outputs["0"], golden.tensor(call.outputs["0"])  # type: ignore[attr-defined]
            control = control_for(golden, "bfloat16", point, "0", "isolated", hidden, depth)  # type: ignore[arg-type]
            result = compare_point(honest, truth, point, control, None)
            assert result.passed and result.detectable is not None
            figure = _figure(result.detectable, kind)
            assert 0 < figure < 0.2  # bfloat16's budgets: a few roundings (2**-8) at most
            for sign in (1.0, -1.0):
                # planted on the replay's output as it came (rounded): the calibrated
                # budgets' figures are a rounding or more, which a second rounding keeps
                caught = _planted(honest, truth, kind, sign * CAUGHT * figure, honest.dtype)
                passed = _planted(honest, truth, kind, sign * PASSED * figure, honest.dtype)
                assert not compare_point(caught, truth, point, control, None).passed
                assert compare_point(passed, truth, point, control, None).passed
            judged += 1
    assert judged


@pytest.mark.parametrize("upstream", [None, 2e-3], ids=["alone", "in-the-model"])
@pytest.mark.parametrize("kind", ["scale", "bias"])
def test_a_pooled_lean_states_the_lean_rule_figure(upstream: float | None, kind: str) -> None:
    """The pooled lean's figure (``lean_detectable``): an honest output pooled over 16,384
    bfloat16 elements, the calibration's leans within ±0.05%; twice the figure planted on
    it fails the lean rule, half passes (its channel leans have no calibrated range here:
    the global leans alone judge)."""
    from numalign.compare.calibration import ControlStats
    from numalign.compare.lean import judge_lean, lean
    from numalign.compare.power import lean_detectable

    g = torch.Generator().manual_seed(7)
    truth = torch.randn(64, 256, generator=g, dtype=torch.float64) + 0.3
    noise = 0.25 * 2.0**-7 * truth * torch.randn(truth.shape, generator=g, dtype=torch.float64)
    honest = truth + noise
    # ±0.05%: about an eighth of a bfloat16 rounding, what honest members lean (lean.py)
    calibration = ControlStats(scale_low=-5e-4, scale_high=5e-4, offset_low=-5e-4,
                               offset_high=5e-4)  # fmt: skip
    measured = lean(honest.to(torch.bfloat16), truth)
    assert measured is not None
    found = lean_detectable(measured, calibration, "bfloat16", 256, upstream=upstream)
    assert found is not None
    figure = _figure(found, kind)
    for size, fails in ((CAUGHT * figure, True), (PASSED * figure, False)):
        for sign in (1.0, -1.0):
            planted = lean(_planted(honest, truth, kind, sign * size, torch.bfloat16), truth)
            assert planted is not None
            finding = judge_lean(planted, calibration, "bfloat16", 256, upstream=upstream)
            assert (finding is not None) == fails
