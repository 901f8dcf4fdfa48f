"""The sweep's honest replay counts tests as pytest did: a decode test that failed its
budgets but was an expected failure (a known divergence of the paged engine, matched by its
signature) is no false alarm; a failed one is, and an error is a crash."""

from __future__ import annotations

from pathlib import Path

import pytest

from numalign.records.drift import DriftRecord, write_records
from numalign.sweep import one
from numalign.sweep.table import SweepRow

PAGED = "suites/models/test_decode.py::test_decode[gemma2-float32-paged]"
STATIC = "suites/models/test_decode.py::test_decode[gemma2-float32-static]"
LAYER = "suites/models/test_layer.py::test_layer[gemma2-bfloat16-model.norm]"


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, records: list[DriftRecord]) -> SweepRow:
    reports = tmp_path / "reports"

    def fake_pytest(suites: Path, golden: Path, out: Path, *args: str) -> tuple[int, str]:
        (out / "latest").mkdir(parents=True)
        write_records(out / "latest" / "records.jsonl", records)
        return 1, "== 1 passed, 1 skipped, 1 xfailed in 1.0s =="

    monkeypatch.setattr(one, "_pytest", fake_pytest)
    row = SweepRow("gemma2", "yes", "ok", "-")
    one.honest(row, tmp_path, tmp_path, reports)
    return row


def test_an_expected_failure_is_no_false_alarm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = [
        DriftRecord(PAGED, verdict="failed", outcome="xfailed"),
        DriftRecord(PAGED, verdict="passed", outcome="xfailed"),
        DriftRecord(STATIC, verdict="passed", outcome="passed"),
    ]
    row = _run(tmp_path, monkeypatch, records)
    assert (row.false_alarms, row.crashes) == (0, 0)
    assert row.replay == "clean (1 passed, 1 skipped, 1 expected failures)"


def test_a_failed_test_is_a_false_alarm_and_an_error_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = [
        DriftRecord(PAGED, verdict="failed", outcome="failed"),
        DriftRecord(STATIC, verdict="passed", outcome="passed"),
        DriftRecord(LAYER, verdict="error", outcome="error"),
    ]
    row = _run(tmp_path, monkeypatch, records)
    assert (row.false_alarms, row.crashes) == (1, 1)
    assert row.replay.startswith("not clean (1 passed")
