"""The operator suite run for real (pytester, in a subprocess) on a kernel module from
outside the repository: every wrong kernel fails, naming its operator and a case that exposes
it; every correct but different kernel passes; all of them reach the drift records."""

from __future__ import annotations

import re

import pytest
from suite_runner import assert_passes_in_every_dtype, run_operator_suite

from numalign.records.drift import DriftRecord

#: wrong kernel -> (operator, a case that must expose it)
WRONG = {
    "wrong_eps": ("rms_norm", "small-16x4096"),
    "wrong_no_upcast": ("rms_norm", "llm-8x4096"),
    "wrong_no_max": ("softmax", "large-16x1000"),
    "wrong_nan_rows": ("softmax", "fully-masked-6x64"),
    "wrong_causal_off_by_one": ("attention", "gqa-causal-1x8x2x33x33x64"),
    "wrong_gqa_mapping": ("attention", "gqa-causal-1x8x2x33x33x64"),
    "wrong_interleaved": ("rope_neox", "small-1x4x17x64"),
    "wrong_low_precision_acc": ("linear", "large-k-2x32768x8"),
    "wrong_dropped_tail": ("linear", "unaligned-7x4097x33"),
    "wrong_no_renorm": ("moe_routing", "mixtral-17x8-top2"),
    "wrong_page_offset": ("paged_attention", "boundaries-6x4x8x64"),
    "wrong_chunk_carry": ("cumsum", "chunk-edges-3x129"),
    "wrong_no_decay_across_chunks": ("gated_delta_rule", "chunk-edges-2x2x129x32"),
    "wrong_one_pass_variance": ("layer_norm", "offset-8x4096"),
    "wrong_window_off_by_one": ("attention", "window-1x4x4x80x80x32"),
    "wrong_smallest": ("topk", "rows-8x1000-k8"),
    "wrong_no_threshold": ("softplus", "large-4x1000"),
}
#: correct but different kernel -> its operator
RIGHT = {"right_divide": "rms_norm", "right_log_softmax": "softmax", "right_math": "attention"}
#: (kernel, operator): what this file runs of the catalogue of planted kernels
KERNELS = [(name, op) for name, (op, _) in WRONG.items()] + list(RIGHT.items())


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[DriftRecord]]:
    """One run of the real suite at tier pr, all dtypes, over this file's planted kernels."""
    return run_operator_suite(tmp_path_factory.mktemp("vendor"), KERNELS)


def test_there_are_at_least_twelve_distinct_wrong_kinds() -> None:
    assert len(WRONG) >= 12  # the acceptance criterion of the operator catalogue


@pytest.mark.parametrize("name", sorted(WRONG))
def test_each_wrong_kernel_fails_on_a_case_that_exposes_it(
    suite_run: tuple[str, list[DriftRecord]], name: str
) -> None:
    output, records = suite_run
    operator, case = WRONG[name]
    failed = re.findall(rf"FAILED \S+::test_{operator}\[{name}-(\w+)-([^\]]+)\]", output)
    assert failed, f"{name} never failed:\n{output[-3000:]}"
    assert case in {c for _, c in failed}, f"{name} did not fail on {case}: {sorted(set(failed))}"
    mine = [r for r in records if r.candidate == name]
    assert any(r.verdict == "failed" and r.case == case for r in mine)


@pytest.mark.parametrize("name", sorted(RIGHT))
def test_each_correct_but_different_kernel_passes_in_every_dtype(
    suite_run: tuple[str, list[DriftRecord]], name: str
) -> None:
    assert_passes_in_every_dtype(*suite_run, name)


def test_failure_messages_name_the_operator_the_kernel_and_the_case(
    suite_run: tuple[str, list[DriftRecord]],
) -> None:
    _, records = suite_run
    failing = next(r for r in records if r.candidate == "wrong_eps" and r.case == "small-16x4096")
    assert failing.verdict == "failed"
    assert str(failing.message).startswith("rms_norm [")
    assert "small-16x4096" in failing.test_id
