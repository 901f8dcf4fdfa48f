"""Outcomes as pytest counts them: xfailed, xpassed, skipped, failed, error, in the terminal
summary, summary.json, drift.csv, drift.html and the records, never an expected failure
counted as failed."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from numalign.records.drift import read_records

OUTCOMES = """
import pytest
import torch
from numalign.compare import CompareSpec, compare

def _record(record_drift, scale, case):
    t = torch.linspace(1, 2, 64, dtype=torch.float64)
    result = compare((t * scale).float(), t, CompareSpec(name="rms_norm"))
    for output in range(4):  # several records per test, as a paged or model test has
        record_drift(result, suite="operators", candidate="c", device="cpu",
                     case=f"{case}-{output}")
    assert result.passed, result.message()

def test_passes(record_drift):
    _record(record_drift, 1.0, "passes")

def test_fails(record_drift):
    _record(record_drift, 1.1, "fails")

@pytest.mark.xfail(reason="paged kernel rounds the scale twice (issue 9)")
def test_known_bug(record_drift):
    _record(record_drift, 1.1, "known")

@pytest.mark.xfail(reason="was broken")
def test_fixed(record_drift):
    _record(record_drift, 1.0, "fixed")

def test_runtime_xfail(record_drift):
    pytest.xfail("no bfloat16 on this device")

def test_skipped(record_drift):
    pytest.skip("needs a GPU")

@pytest.fixture
def broken():
    raise OSError("model folder unreadable")

def test_setup_error(broken, record_drift):
    pass
"""


class Run:
    """One pytest session over OUTCOMES, shared by this module's tests (a session is slow)."""

    def __init__(self, stdout: str) -> None:
        self.stdout = stdout

    def parseoutcomes(self) -> dict[str, int]:
        """pytest's last line, as ``RunResult.parseoutcomes`` reads it."""
        last = [line for line in self.stdout.splitlines() if line.startswith("=")][-1]
        found = re.findall(r"(\d+) (\w+)", last)
        plural = {"errors": "error", "warnings": "warnings"}
        return {plural.get(word, word): int(n) for n, word in found if word != "in"}


@pytest.fixture(scope="module")
def outcome_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    root = tmp_path_factory.mktemp("outcomes")
    (root / "test_outcomes.py").write_text(OUTCOMES)
    (root / "pytest.ini").write_text("[pytest]\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--report-dir", "out",
         "-p", "no:cacheprovider", "test_outcomes.py"],
        cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr  # 1: tests failed, as built to
    return Run(done.stdout), root / "out" / "latest"


PYTEST_SAYS = {"passed": 1, "failed": 1, "xfailed": 2, "xpassed": 1, "skipped": 1, "error": 1}


def test_pytest_counts_what_the_fixture_file_is_built_to_give(
    outcome_run: tuple[Run, Path],
) -> None:
    run, _ = outcome_run
    assert {k: v for k, v in run.parseoutcomes().items() if k != "warnings"} == PYTEST_SAYS


def test_summary_json_counts_tests_as_pytest_and_records_by_status(
    outcome_run: tuple[Run, Path],
) -> None:
    _, latest = outcome_run
    summary = json.loads((latest / "summary.json").read_text())
    assert summary["tests"] == PYTEST_SAYS
    # 4 records each: passes, fails, the known bug (xfailed) and the fixed one (xpassed); the
    # setup that raised has its error record; a skip and a runtime xfail recorded nothing
    assert summary["records_by_status"] == {
        "failed": 4, "error": 1, "xpassed": 4, "xfailed": 4, "passed": 4,
    }  # fmt: skip
    assert summary["expected_failures"] == [
        {
            "test_id": "test_outcomes.py::test_known_bug",
            "reason": "paged kernel rounds the scale twice (issue 9)",
        }
    ]
    by_status = {row["verdict"] for row in summary["by_suite_dtype"]}
    assert by_status == {"failed", "error", "xfailed", "xpassed", "passed"}


def test_records_carry_the_test_outcome_and_the_expected_reason(
    outcome_run: tuple[Run, Path],
) -> None:
    _, latest = outcome_run
    records = read_records(latest)
    known = [r for r in records if r.test_id.endswith("test_known_bug")]
    assert {(r.verdict, r.outcome, r.status) for r in known} == {("failed", "xfailed", "xfailed")}
    assert {r.xfail_reason for r in known} == {"paged kernel rounds the scale twice (issue 9)"}
    fixed = [r for r in records if r.test_id.endswith("test_fixed")]
    assert {r.status for r in fixed} == {"xpassed"}
    with (latest / "drift.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {row["outcome"] for row in rows if row["test_id"].endswith("test_known_bug")} == {
        "xfailed"
    }


def test_terminal_summary_counts_as_pytest_and_names_the_expected_failure(
    outcome_run: tuple[Run, Path],
) -> None:
    run, _ = outcome_run
    out = run.stdout
    assert (
        "numalign: 7 tests: 1 failed, 1 error, 1 xpassed, 2 xfailed, 1 skipped, 1 passed; "
        "17 records: 4 failed, 1 error, 4 xpassed, 4 xfailed, 4 passed"
    ) in out
    worst = out.split("numalign drift", 1)[1]
    assert "xfailed" not in worst.split("expected failure", 1)[0]  # never among the worst
    assert (
        "expected failure  test_outcomes.py::test_known_bug: paged kernel rounds the scale "
        "twice (issue 9)"
    ) in worst


def test_drift_html_shows_an_expected_failure_as_expected(
    outcome_run: tuple[Run, Path],
) -> None:
    _, latest = outcome_run
    html = (latest / "drift.html").read_text()
    top = html.split('id="summary"', 1)[0]
    assert "FAILED: 7 tests: 1 failed, 1 error, 1 xpassed, 2 xfailed, 1 skipped, 1 passed" in top
    failing = top.split('id="failures"', 1)[1].split("</table>", 1)[0]
    assert "test_outcomes.py::test_fails" in failing and "test_outcomes.py::test_fixed" in failing
    assert "test_known_bug" not in failing  # expected: listed apart, with its reason
    expected = top.split('id="expected"', 1)[1]
    assert "paged kernel rounds the scale twice (issue 9)" in expected
    assert "(expected: paged kernel rounds the scale twice (issue 9))" in html


def test_an_expected_failure_is_not_a_regression() -> None:
    from numalign.records.drift import DriftRecord
    from numalign.report.baseline import diff_runs

    before = DriftRecord("t::test_paged", point="p", verdict="passed", budget_used=0.2)
    failing = before.with_fields(verdict="failed", budget_used=9.0)
    assert len(diff_runs([failing.with_fields(outcome="failed")], [before]).regressed) == 1
    expected = failing.with_fields(outcome="xfailed", xfail_reason="known bug")
    assert diff_runs([expected], [before]).regressed == []


def test_an_int64_output_of_a_bfloat16_test_is_counted_under_bfloat16() -> None:
    import torch

    from numalign.compare import CompareSpec, compare
    from numalign.records.drift import DriftRecord
    from numalign.report.html import render_html
    from numalign.report.tables import summarize

    t = torch.arange(8)
    test = "suites/operators/test_operators.py::test_topk[fused-bfloat16-llm]"
    result = compare(t, t, CompareSpec(name="topk.indices"))
    record = DriftRecord.from_result(result, test_id=test, suite="operators")
    assert record.dtype == "int64" and record.test_dtype == "bfloat16"
    summary = summarize([record], {}, {})
    assert {row["dtype"] for row in summary["by_suite_dtype"]} == {"bfloat16"}
    html = render_html([record], summary)
    heat = html.split('id="heatmap"', 1)[1].split("</table>", 1)[0]
    assert "<th>bfloat16</th>" in heat and "int64" not in heat
