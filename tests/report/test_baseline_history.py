"""Baselines, regressions, history and merging."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from numalign.report import diff_runs, merge_runs, render_run
from numalign.report.history import read_history


def write_run(folder: Path, records: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True)
    with (folder / "records.jsonl").open("w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return folder


def test_growth_beyond_the_factor_regresses_even_while_passing(run_records: list[dict]) -> None:
    current = copy.deepcopy(run_records)
    grown = current[1]
    assert grown["verdict"] == "passed"
    before = grown["budget_used"]
    baseline = copy.deepcopy(run_records)
    grown["budget_used"] = min(0.9, before * 3 + 0.1)  # still passing, 3x worse
    diff = diff_runs(current, baseline)
    assert [r["test_id"] for r in diff.regressed] == [grown["test_id"]]
    assert diff.regressed[0]["verdict"] == "passed"
    assert diff.compared == len(run_records)


def test_noise_below_the_floor_and_within_the_factor_is_not_a_regression(
    run_records: list[dict],
) -> None:
    current = copy.deepcopy(run_records)
    current[0]["budget_used"] = 0.01  # from ~0: big ratio, but far below the noise floor
    current[1]["budget_used"] = current[1]["budget_used"] * 1.5  # within the factor 2
    assert diff_runs(current, run_records).regressed == []


def test_newly_failing_new_and_vanished_records(run_records: list[dict]) -> None:
    current = copy.deepcopy(run_records)
    current[2]["verdict"] = "failed"
    vanished = current.pop(3)
    current.append({**current[0], "test_id": "brand-new"})
    diff = diff_runs(current, run_records)
    assert [r["test_id"] for r in diff.regressed] == [current[2]["test_id"]]
    assert diff.new == ["brand-new::" + current[0]["point"]]
    assert diff.vanished == [f"{vanished['test_id']}::{vanished['point']}"]


def test_the_factor_must_exceed_one(run_records: list[dict]) -> None:
    with pytest.raises(ValueError, match="above 1"):
        diff_runs(run_records, run_records, factor=1.0)


def test_render_run_writes_everything_and_appends_history(
    tmp_path: Path, run_records: list[dict]
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


def test_merge_joins_shards(tmp_path: Path, run_records: list[dict]) -> None:
    half = len(run_records) // 2
    a = write_run(tmp_path / "shard1", run_records[:half])
    b = write_run(tmp_path / "shard2", run_records[half:])
    merged = merge_runs([a, b], tmp_path / "merged")
    lines = (merged / "records.jsonl").read_text().splitlines()
    assert sorted(lines) == sorted(json.dumps(r) for r in run_records)


def test_fail_on_regression_fails_the_session(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        """
import os
import torch
from numalign.compare import compare

def test_drift(record_drift):
    t = torch.linspace(1, 2, 64, dtype=torch.float64)
    scale = float(os.environ["SCALE"])
    r = compare((t * (1 + scale)).to(torch.bfloat16), t, control=t.to(torch.bfloat16), name="p")
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
