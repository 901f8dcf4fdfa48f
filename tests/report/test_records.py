"""Records travel from xdist workers to the controller; none is lost when a worker dies."""

from __future__ import annotations

import json

import pytest

from numalign.record import read_records

COMPARISONS = """
import os
import pytest
import torch
from numalign.compare import compare

@pytest.mark.parametrize("i", range(200))
def test_compare(i, record_drift):
    if i == {kill} and os.environ.get("KILL_ONE"):
        os._exit(3)  # the worker dies in the middle of the run
    t = torch.full((8,), float(i), dtype=torch.float64)
    result = compare(t.float(), t, name=f"point{{i}}")
    record_drift(result, suite="operators", candidate="c", device="cpu", case=str(i))
    assert result.passed
"""


def _run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, list[dict]]:
    pytester.makepyfile(COMPARISONS.format(kill=77))
    result = pytester.runpytest_subprocess(
        "-n", "2", "--report-dir", "out", "-p", "no:cacheprovider", *args
    )
    return result, read_records(pytester.path / "out" / "latest")


def test_two_hundred_comparisons_give_two_hundred_records(pytester: pytest.Pytester) -> None:
    result, records = _run(pytester)
    result.assert_outcomes(passed=200)
    assert len(records) == 200
    assert sorted(int(r["case"]) for r in records) == list(range(200))
    summary = json.loads((pytester.path / "out" / "latest" / "summary.json").read_text())
    assert summary["records"] == 200


def test_a_killed_worker_loses_no_other_record(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILL_ONE", "1")
    _, records = _run(pytester)
    crashed = [r for r in records if r["verdict"] == "crashed"]
    assert [r["test_id"] for r in crashed] == [
        "test_a_killed_worker_loses_no_other_record.py::test_compare[77]"
    ]
    assert "crashed" in crashed[0]["message"]
    others = [r for r in records if r["verdict"] == "passed"]
    assert len(others) == 199  # every record but the killed test's
    html = (pytester.path / "out" / "latest" / "drift.html").read_text()
    assert "crashed" in html


def test_a_cut_last_line_is_skipped_and_a_broken_middle_line_is_an_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    good = json.dumps({"test_id": "a", "verdict": "passed"})
    (tmp_path / "records.jsonl").write_text(good + "\n" + good[:10])
    assert len(read_records(tmp_path)) == 1
    (tmp_path / "records.jsonl").write_text(good[:10] + "\n" + good + "\n")
    with pytest.raises(ValueError, match=r"records.jsonl:1: not a JSON record"):
        read_records(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"expected a run folder holding records\.jsonl"):
        read_records(tmp_path / "nowhere")


def test_a_session_without_comparisons_writes_no_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_plain(): pass")
    pytester.runpytest("--report-dir", "out").assert_outcomes(passed=1)
    assert not (pytester.path / "out").exists()
