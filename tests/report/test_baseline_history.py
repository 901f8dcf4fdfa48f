"""Baselines, regressions, history and merging."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from numalign.records.drift import DriftRecord, read_records, write_records
from numalign.report import diff_runs, merge_runs, render_run
from numalign.report.history import read_history


def write_run(folder: Path, records: list[DriftRecord]) -> Path:
    folder.mkdir(parents=True)
    write_records(folder / "records.jsonl", records)
    return folder


def test_growth_beyond_the_factor_regresses_even_while_passing(
    run_records: list[DriftRecord],
) -> None:
    current = copy.deepcopy(run_records)
    # the passing record that used the least budget: tripled, it still passes
    grown = min((r for r in current if r.verdict == "passed"), key=lambda r: r.budget_used or 0)
    before = grown.budget_used or 0.0
    assert before < 0.25  # a passing record of the synthetic run uses far less than 1/4
    baseline = copy.deepcopy(run_records)
    grown.budget_used = before * 3 + 0.1  # still passing (below 0.85), over 3x worse
    diff = diff_runs(current, baseline)
    assert [r["test_id"] for r in diff.regressed] == [grown.test_id]
    assert diff.regressed[0]["verdict"] == "passed"
    assert diff.compared == len([r for r in run_records if r.verdict != "skipped"])


def test_noise_below_the_floor_and_within_the_factor_is_not_a_regression(
    run_records: list[DriftRecord],
) -> None:
    current = copy.deepcopy(run_records)
    current[0].budget_used = 0.01  # from ~0: big ratio, but far below the noise floor
    current[1].budget_used = (current[1].budget_used or 0.0) * 1.5  # within the factor 2
    assert diff_runs(current, run_records).regressed == []


def test_the_noise_floor_is_the_projects_from_pyproject(
    run_records: list[DriftRecord], tmp_path: Path
) -> None:
    """``[tool.numalign.thresholds] noise_floor`` reaches the report's baseline diff: a use
    grown from 0.01 to 0.2 (20x, over the factor 2) regresses above the default floor and is
    noise below a floor of 0.3."""
    from numalign.compare import load_policy

    baseline = copy.deepcopy(run_records)
    baseline[0].budget_used = 0.01
    current = copy.deepcopy(baseline)
    current[0].budget_used = 0.2
    old = write_run(tmp_path / "old", baseline)
    default = render_run(write_run(tmp_path / "a", current), baseline=old)
    assert default.diff is not None and len(default.diff.regressed) == 1
    (tmp_path / "pyproject.toml").write_text("[tool.numalign.thresholds]\nnoise_floor = 0.3\n")
    thresholds = load_policy(tmp_path / "pyproject.toml").thresholds
    raised = render_run(write_run(tmp_path / "b", current), baseline=old, thresholds=thresholds)
    assert raised.diff is not None and raised.diff.regressed == []


def test_newly_failing_new_and_vanished_records(run_records: list[DriftRecord]) -> None:
    current = copy.deepcopy(run_records)
    current[2].verdict = "failed"
    vanished = current.pop(3)
    current.append(current[0].with_fields(test_id="brand-new"))
    diff = diff_runs(current, run_records)
    assert [r["test_id"] for r in diff.regressed] == [current[2].test_id]
    assert diff.new == [f"brand-new::{current[0].point}::::"]
    assert diff.vanished == [vanished.key]


def test_every_request_has_its_own_key_so_a_regression_in_any_is_seen(
    run_records: list[DriftRecord], tmp_path: Path
) -> None:
    models = [r for r in run_records if r.suite == "models"]
    assert len({r.key for r in run_records}) == len(run_records)
    # merging a run with itself keeps every record
    run = write_run(tmp_path / "run", run_records)
    merged = read_records(merge_runs([run, run], tmp_path / "merged"))
    assert len(merged) == len(run_records)
    # a regression in the second request of a point, the first unchanged
    current = copy.deepcopy(run_records)
    second = next(r for r in current if r.suite == "models" and r.request == "text-rightpad"
                  and r.mode == "accumulated")  # fmt: skip
    twin = next(r for r in models if r.point == second.point and r.mode == second.mode
                and r.request == "text-leftpad")  # fmt: skip
    second.verdict, second.budget_used = "failed", 1.5
    diff = diff_runs(current, run_records)
    assert [r["request"] for r in diff.regressed] == ["text-rightpad"]
    assert twin.verdict == "passed"


def test_schema_1_records_still_read(tmp_path: Path) -> None:
    old = {
        "schema": 1,
        "test_id": "suites/models/test_model.py::test_model[m-bfloat16]",
        "suite": "models",
        "point": "model.norm",
        "case": "text-leftpad",
        "verdict": "passed",
        "metrics": {"max_abs": 0.1},
        "budget": None,
        "model": "m",
        "mode": "accumulated",
    }
    (tmp_path / "records.jsonl").write_text(json.dumps(old) + "\n")
    (record,) = read_records(tmp_path)
    assert record.request == "text-leftpad" and record.budget == {}
    assert record.key.endswith("::model.norm::text-leftpad::")


def test_the_factor_must_exceed_one(run_records: list[DriftRecord]) -> None:
    with pytest.raises(ValueError, match="above 1"):
        diff_runs(run_records, run_records, factor=1.0)


def test_render_run_writes_everything_and_appends_history(
    tmp_path: Path, run_records: list[DriftRecord]
) -> None:
    history = tmp_path / "history.jsonl"
    first = write_run(tmp_path / "run1", run_records)
    render_run(first, history=history, append=True)
    second = write_run(tmp_path / "run2", run_records)
    rendered = render_run(second, baseline=first, history=history, append=True)
    names = {p.name for p in rendered.written}
    assert {"drift.csv", "summary.json", "drift.html", "regressions.json"} <= names
    entries = read_history(history)
    assert [e["run_id"] for e in entries] == ["run1", "run2"]
    assert entries[1]["worst_budget_used"]["operators"]["gelu"] > 1.0  # the broken one
    assert "worst use of budget per run" in (second / "drift.html").read_text()


def test_merge_joins_shards(tmp_path: Path, run_records: list[DriftRecord]) -> None:
    half = len(run_records) // 2
    a = write_run(tmp_path / "shard1", run_records[:half])
    b = write_run(tmp_path / "shard2", run_records[half:])
    merged = merge_runs([a, b], tmp_path / "merged")
    lines = (merged / "records.jsonl").read_text().splitlines()
    assert sorted(lines) == sorted(json.dumps(r.to_dict()) for r in run_records)


def test_fail_on_regression_fails_the_session(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        """
import os
import torch
from numalign.compare import CompareSpec, compare

def test_drift(record_drift):
    t = torch.linspace(1, 2, 64, dtype=torch.float64)
    scale = float(os.environ["SCALE"])
    spec = CompareSpec(control=t.to(torch.bfloat16), name="p")
    r = compare((t * (1 + scale)).to(torch.bfloat16), t, spec)
    record_drift(r, suite="operators", candidate="c", device="cpu", case="x")
"""
    )
    monkeypatch.setenv("SCALE", "0.0005")
    base = pytester.runpytest_subprocess("--report-dir", "base", "-p", "no:cacheprovider")
    assert base.ret == 0
    baseline = (pytester.path / "base" / "latest").resolve()
    monkeypatch.setenv("SCALE", "0.004")  # still within the budget, 8x the error
    args = ["--report-dir", "now", "--drift-baseline", str(baseline), "-p", "no:cacheprovider"]
    warned = pytester.runpytest_subprocess(*args)
    assert warned.ret == 0  # regressions are reported, not fatal, by default
    failed = pytester.runpytest_subprocess(*args, "--fail-on-regression")
    assert failed.ret == pytest.ExitCode.TESTS_FAILED
    failed.stdout.fnmatch_lines(["*1 regression(s) against*", "*regressed*test_drift*"])
