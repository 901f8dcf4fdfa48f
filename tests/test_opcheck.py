"""The operator engine (``numalign.ops.check``) on its own, without the suite: one case's
truth, control and candidate, each output judged by its kind, the verdict object the suite
records and fails through, and the per-worker caches of truths and controls."""

from __future__ import annotations

import torch

from numalign.ops import check as opcheck
from numalign.ops.check import OperatorVerdict, check_operator, inputs_and_truth
from numalign.ops.registry import OPERATORS, Candidate, Operator, candidates, load_catalogue

load_catalogue()
CPU = torch.device("cpu")


def _case(op: Operator, name: str, tier: str = "smoke"):
    return next(c for c in op.cases_for(tier) if c.name == name)


def _candidate(op: Operator, fn, name: str = "planted") -> Candidate:
    return Candidate(operator=op.name, name=name, fn=fn, module="tests.test_opcheck")


def test_the_reference_itself_passes_every_output_with_a_budget_from_the_control() -> None:
    op = OPERATORS["rms_norm"]
    case = _case(op, "small-16x4096")
    results = check_operator(op, _candidate(op, op.reference), case, torch.bfloat16, CPU)
    assert [r.name for r in results] == ["rms_norm"]  # one result per output
    (result,) = results
    assert result.passed, result.message()
    assert result.rule == "budget" and result.control is not None
    # the control is the same reference in bfloat16: the candidate errs exactly as it does,
    # so it uses at most a quarter of the budget (the worst element may be 4x the control's)
    assert result.metrics.max_abs == result.control.max_abs
    assert result.budget_used <= 0.25 + 1e-9


def test_a_scale_error_fails_and_the_verdict_names_candidate_case_and_output() -> None:
    op = OPERATORS["rms_norm"]
    case = _case(op, "small-16x4096")

    def one_percent_large(x, weight, eps, offset=0.0):
        return op.reference(x, weight, eps, offset) * 1.01  # 1%: ~2.5 bfloat16 roundings

    cand = _candidate(op, one_percent_large)
    verdict = OperatorVerdict(
        cand, case, tuple(check_operator(op, cand, case, torch.bfloat16, CPU))
    )
    assert not verdict.passed
    message = verdict.message()
    assert message.startswith(f"candidate 'planted' (tests.test_opcheck) on case {case.name}")
    assert "rms_norm [" in message
    (record,) = verdict.records("tests/test_opcheck.py::t", suite="operators", case=case.name)
    assert record.verdict == "failed" and record.test_id == "tests/test_opcheck.py::t"


def test_ties_outputs_accept_any_index_among_tied_scores_but_not_a_wrong_one() -> None:
    op = OPERATORS["topk"]
    case = _case(op, "rows-8x1000-k8")

    def smallest(x, k):
        values, indices = torch.topk(x, k, dim=-1, largest=False, sorted=True)
        return values, indices

    honest = check_operator(op, _candidate(op, op.reference, "ref"), case, torch.float32, CPU)
    wrong = check_operator(op, _candidate(op, smallest), case, torch.float32, CPU)
    assert all(r.passed for r in honest)
    by_name = {r.name: r for r in wrong}
    assert not by_name["topk.indices"].passed and not by_name["topk.values"].passed


def test_a_truncating_quantizer_fails_by_the_rounding_rule() -> None:
    op = OPERATORS["quantize_int8"]
    case = _case(op, "rows-8x4096")
    honest = next(iter(candidates(op.name).values()))

    def truncates(x):
        q, scale = honest.fn(x)
        # round toward zero instead of to nearest: the codes' error leans one way
        return torch.trunc(x.float() / scale.float()).clamp(-127, 127).to(q.dtype), scale

    (q, scale) = check_operator(op, _candidate(op, truncates), case, torch.float32, CPU)
    assert not q.passed and q.rule == "rounding"
    assert scale.passed  # the scale is the honest one


def test_candidates_see_the_inputs_rounded_to_the_dtype_and_strided_where_the_case_says() -> None:
    op = OPERATORS["rms_norm"]
    case = _case(op, "noncontig-9x768", tier="pr")
    seen: list[torch.Tensor] = []

    def spy(x, weight, eps, offset=0.0):
        seen.append(x)
        return op.reference(x, weight, eps, offset)

    (result,) = check_operator(op, _candidate(op, spy), case, torch.float16, CPU)
    assert result.passed, result.message()
    (x,) = seen
    assert x.dtype == torch.float16 and not x.is_contiguous()
    rounded, _ = inputs_and_truth(op, case, torch.float16)
    torch.testing.assert_close(x, rounded["x"], rtol=0, atol=0)  # the same values, rounded


def test_truths_are_kept_per_worker_and_bounded() -> None:
    op = OPERATORS["rms_norm"]
    first = inputs_and_truth(op, _case(op, "tiny-3x8"), torch.float32)
    assert inputs_and_truth(op, _case(op, "tiny-3x8"), torch.float32) is first  # reused
    assert first[1]["out"].dtype == torch.float64  # the truth is float64
    for name in ("one-1x1", "llm-8x4096", "small-16x4096", "outliers-16x4096", "prime-7x1031"):
        inputs_and_truth(op, _case(op, name), torch.float32)
    # the per-worker cache holds the last _TRUTH_CACHE_SIZE entries: the first is gone
    assert len(opcheck._truths) <= opcheck._TRUTH_CACHE_SIZE
    assert inputs_and_truth(op, _case(op, "tiny-3x8"), torch.float32) is not first
