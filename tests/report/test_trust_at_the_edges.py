"""Issue 42, "Trust at the edges": a run's records and reports never abort and never read
as a pass they are not. A NaN metric is written and read back (the session goes on); a torn
or empty baseline is refused with its file named; a report rebuilt from records a full disk
cut says INCOMPLETE against its session's count; a run that skipped most of a set's tests for
want of calibration says NOT JUDGED."""

from __future__ import annotations

import errno
import json
import math
from pathlib import Path
from typing import Any

import pytest

from numalign.core.errors import UNCALIBRATED
from numalign.records.drift import DriftRecord, read_records, write_records
from numalign.report.verdict import NOT_JUDGED_SHARE, judge_run


def _strict(text: str) -> Any:
    """JSON as a strict reader takes it: the bare NaN and Infinity tokens refused."""

    def refuse(token: str) -> None:
        raise ValueError(f"not strict JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def _run_dir(root: Path) -> Path:
    return next(p for p in root.iterdir() if p.is_dir() and p.name[0].isdigit())


# -- item 1: a non-finite metric ------------------------------------------------------------------
NAN_TESTS = """
import pytest
import torch
from numalign.compare import CompareSpec, compare
from numalign.records.drift import DriftRecord

@pytest.mark.parametrize("i", range(5))
def test_compare(i, record_drift):
    t = torch.full((8,), float(i + 1), dtype=torch.float64)
    record_drift(compare(t.float(), t, CompareSpec(name=f"p{i}")), suite="operators",
                 candidate="c", device="cpu", case=str(i))

def test_nan_logits(record_drift):
    # as replay.verdict.logits_record makes it: logits statistics merged into the metrics; a
    # mask filled from float32's minimum in bfloat16 turned the padded rows to NaN
    t = torch.ones(8, dtype=torch.float64)
    record = DriftRecord.from_result(compare(t.float(), t, CompareSpec(name="logits")),
                                     test_id=record_drift.nodeid, suite="models",
                                     candidate="c", device="cpu", case="nan")
    record.metrics |= {"max_abs": float("nan"), "kl_max": float("nan"),
                       "norm_ratio": float("inf")}
    record_drift.add(record.with_fields(verdict="failed", budget_used=float("nan")))
    pytest.fail("logits: KL divergence nan", pytrace=False)
"""


def test_a_nan_metric_is_recorded_and_every_test_gets_its_verdict(
    pytester: pytest.Pytester,
) -> None:
    """Before: ``json.dumps(allow_nan=False)`` raised in the record writer, pytest stopped with
    an INTERNALERROR and the tests after it got no verdict. Now the NaN record is written, the
    test fails, the others pass, and records, tables, summary, history and drift.html are
    written, as strict JSON where they are JSON."""
    pytester.makepyfile(NAN_TESTS)
    result = pytester.runpytest("--report-dir", "out", "-p", "no:cacheprovider")
    assert "INTERNALERROR" not in result.stdout.str()
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(["*nan of budget  failed  *test_nan_logits*"])  # the worst
    run = _run_dir(pytester.path / "out")
    for line in (run / "records.jsonl").read_text().splitlines():
        _strict(line)
    records = {r.case: r for r in read_records(run)}
    assert len(records) == 6
    nan = records["nan"]
    assert math.isnan(nan.metrics["max_abs"]) and math.isnan(nan.metrics["kl_max"])
    assert nan.metrics["norm_ratio"] == math.inf and math.isnan(nan.budget_used or 0.0)
    assert nan.used == math.inf  # a NaN use ranks as the worst: beyond any budget
    assert nan.outcome == "failed"
    summary = _strict((run / "summary.json").read_text())
    assert summary["tests"] == {"failed": 1, "passed": 5}
    assert summary["verdict"] == "failed"
    assert summary["worst_budget_used"]["models"] == "Infinity"
    for line in (pytester.path / "out" / "history.jsonl").read_text().splitlines():
        _strict(line)
    assert (run / "drift.csv").read_text().count("\n") == 7  # a header and 6 records
    html = (run / "drift.html").read_text()
    assert "FAILED: 6 tests" in html
    assert '"max_abs": "NaN"' in html  # the worst-offenders table shows NaN, not n/a


def test_a_record_json_has_no_form_for_is_an_error_record_not_an_abort(
    pytester: pytest.Pytester,
) -> None:
    """A field holding an object (a tensor) fails JSON with TypeError: the test keeps its
    verdict and the run its report; the record says what could not be written."""
    pytester.makepyfile(
        """
import torch
from numalign.records.drift import DriftRecord

def test_tensor_metric(record_drift):
    record_drift.add(DriftRecord(test_id="t", metrics={"max_abs": torch.tensor(1.0)}))

def test_after():
    pass
"""
    )
    result = pytester.runpytest("--report-dir", "out", "-p", "no:cacheprovider")
    assert "INTERNALERROR" not in result.stdout.str()
    result.assert_outcomes(passed=2)
    (record,) = read_records(_run_dir(pytester.path / "out"))
    assert record.verdict == "error" and "could not be written as JSON" in str(record.reason)


def test_the_baseline_diff_and_allure_read_non_finite_metrics(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A record whose use of budget became NaN regresses against a finite baseline (NaN
    compares false with everything: it would pass as no growth); its Allure attachment is
    strict JSON."""
    import allure

    from numalign.report.allure import _attach
    from numalign.report.baseline import diff_runs

    before = DriftRecord(test_id="t", point="logits", budget_used=0.2, metrics={"max_abs": 0.1})
    now = before.with_fields(budget_used=math.nan, metrics={"max_abs": math.nan})
    write_records(tmp_path / "records.jsonl", [now])
    (read,) = read_records(tmp_path)
    diff = diff_runs([read], [before])
    assert [r["key"] for r in diff.regressed] == [before.key]
    attached: list[str] = []
    monkeypatch.setattr(allure, "attach", lambda body, **kwargs: attached.append(body))
    _attach(read.with_fields(verdict="failed"))
    assert _strict(attached[0])["metrics"] == {"max_abs": "NaN"}


# -- item 2: a torn or empty baseline -------------------------------------------------------------
def _baseline(tmp_path: Path, how: str) -> Path:
    """A baseline run folder whose records.jsonl is ``torn`` (cut in its last record's line)
    or ``empty``."""
    run = tmp_path / "baseline"
    run.mkdir()
    records = [DriftRecord(test_id=f"t{i}", point="p", budget_used=0.1) for i in range(3)]
    write_records(run / "records.jsonl", records)
    text = (run / "records.jsonl").read_text()
    (run / "records.jsonl").write_text(text[: len(text) - 40] if how == "torn" else "")
    return run


@pytest.mark.parametrize("how", ["torn", "empty"])
def test_a_torn_or_empty_baseline_is_refused_naming_its_file(
    pytester: pytest.Pytester, how: str
) -> None:
    """Before: exit 0, the lost records counted "new" and 0 regressions, so
    --fail-on-regression could not see them. Now the session refuses the baseline before the
    first test, naming the file (and the line of a torn one) and how to fix it."""
    baseline = _baseline(pytester.path, how)
    with pytest.raises(ValueError, match="re-run its session, or point at the right run"):
        read_records(baseline, whole=True)
    read_records(baseline)  # a run's own records still read a cut last line away
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest(
        "--report-dir", "out", "--drift-baseline", str(baseline), "--fail-on-regression"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    where = "records.jsonl:3: a record cut mid-line" if how == "torn" else "holds no record"
    result.stderr.fnmatch_lines([f"*--drift-baseline {baseline}: *{where}*re-run its session*"])


@pytest.mark.parametrize("how", ["torn", "empty"])
def test_numalign_report_refuses_a_torn_or_empty_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    from numalign.cli import main

    run = tmp_path / "run"
    run.mkdir()
    write_records(run / "records.jsonl", [DriftRecord(test_id="t0", point="p")])
    baseline = _baseline(tmp_path, how)
    assert main(["report", str(run), "--baseline", str(baseline)]) == 1
    assert str(baseline / "records.jsonl") in capsys.readouterr().err
    assert not (run / "drift.html").exists()  # no report that reads as compared


# -- item 3: a report rebuilt from records a full disk cut ----------------------------------------
COMPARISONS = """
import pytest
import torch
from numalign.compare import CompareSpec, compare

@pytest.mark.parametrize("i", range(10))
def test_compare(i, record_drift):
    t = torch.full((8,), float(i), dtype=torch.float64)
    record_drift(compare(t.float(), t, CompareSpec(name=f"p{i}")), suite="operators",
                 candidate="c", device="cpu", case=str(i))
"""


def _full(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_rebuilt_report_of_a_session_that_never_wrote_its_end_is_incomplete(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills after the second record and stays full: the records of 8 tests, the
    session's end and the tables are lost. Before, ``numalign report`` rebuilt a PASSED report
    of 2 tests; now it reads INCOMPLETE against the 10 tests the session selected."""
    import numalign.report.collector as collector
    from numalign.cli import main
    from numalign.records.drift import RecordWriter

    real = RecordWriter.write

    def filling(self: RecordWriter, record: DriftRecord) -> None:
        if self.count >= 2:
            _full()
        real(self, record)

    real_session = collector.write_session
    monkeypatch.setattr(RecordWriter, "write", filling)
    monkeypatch.setattr(collector, "write_records", _full)  # the rewrite at the end too
    monkeypatch.setattr(  # the session file: its start written, its end never
        collector, "write_session",
        lambda run_dir, s: _full() if s["finished"] else real_session(run_dir, s),
    )  # fmt: skip
    pytester.makepyfile(COMPARISONS)
    result = pytester.runpytest("--report-dir", "out", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=10)
    monkeypatch.undo()  # space freed
    run = _run_dir(pytester.path / "out")
    assert sorted(p.name for p in run.iterdir()) == ["records.jsonl", "session.json"]
    assert main(["report", str(run)]) == 1  # rebuilt, and not a pass
    summary = _strict((run / "summary.json").read_text())
    assert summary["verdict"] == "incomplete"
    assert summary["missing"] == {"finished": False, "selected": 10, "tests_recorded": 2}
    html = (run / "drift.html").read_text()
    assert "INCOMPLETE: 2 tests" in html and "PASSED" not in html
    assert "never wrote its end (killed, or its disk filled): 10 tests selected, 2 with" in html


def test_a_rebuilt_report_of_records_cut_after_the_session_counts_what_they_lack(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    """The session ended whole (its file says 10 tests handed 10 records); its records were
    cut to 2 afterwards: the rebuilt report names the 8 tests and records missing."""
    from numalign.cli import main

    pytester.makepyfile(COMPARISONS)
    result = pytester.runpytest("--report-dir", "out", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    run = _run_dir(pytester.path / "out")
    assert _strict((run / "summary.json").read_text())["verdict"] == "passed"
    lines = (run / "records.jsonl").read_text().splitlines()
    (run / "records.jsonl").write_text("\n".join(lines[:2]) + "\n")
    (run / "summary.json").unlink()  # never written: the disk was full
    assert main(["report", str(run)]) == 1
    assert "INCOMPLETE: 8 of the 10 tests that handed records have none here" in (
        capsys.readouterr().err
    )
    summary = _strict((run / "summary.json").read_text())
    assert summary["tests"] == {"passed": 10}  # the session's own count, from its file
    assert summary["missing"] == {"finished": True, "tests": 8, "of": 10, "records": 8,
                                  "of_records": 10}  # fmt: skip
    assert "INCOMPLETE: 10 tests: 10 passed" in (run / "drift.html").read_text()


def test_a_merge_of_shards_says_what_a_cut_shard_lacks(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two shards of 10 tests each, the second's records cut to 2 after its session ended:
    their merge reads INCOMPLETE (it read passed with 12 tests); merged whole, passed."""
    from numalign.cli import main

    pytester.makepyfile(test_a=COMPARISONS, test_b=COMPARISONS)
    for shard in ("a", "b"):
        result = pytester.runpytest(f"test_{shard}.py", "--report-dir", f"out-{shard}",
                                    "-p", "no:cacheprovider")  # fmt: skip
        assert result.ret == pytest.ExitCode.OK
    a, b = (_run_dir(pytester.path / f"out-{shard}") for shard in ("a", "b"))
    assert main(["report", "merge", str(a), str(b), "--out", str(pytester.path / "whole")]) == 0
    assert _strict((pytester.path / "whole" / "summary.json").read_text())["verdict"] == "passed"
    lines = (b / "records.jsonl").read_text().splitlines()
    (b / "records.jsonl").write_text("\n".join(lines[:2]) + "\n")
    merged = pytester.path / "merged"
    assert main(["report", "merge", str(a), str(b), "--out", str(merged)]) == 1
    assert "INCOMPLETE: 8 of the 20 tests that handed records have none here" in (
        capsys.readouterr().err
    )
    summary = _strict((merged / "summary.json").read_text())
    assert summary["missing"] == {"finished": True, "tests": 8, "of": 20, "records": 8,
                                  "of_records": 20}  # fmt: skip


# -- item 4: a run that skipped most tests for want of calibration --------------------------------
def _skipped(test_id: str, model: str) -> DriftRecord:
    return DriftRecord.for_test(test_id, "skipped", rule=UNCALIBRATED, model=model,
                                suite="models", reason="no calibration")  # fmt: skip


def _layer(model: str, i: int) -> str:
    return f"suites/models/test_layers.py::test_layer[{model}/model.layers.{i}-bfloat16]"


def test_a_set_mostly_skipped_for_want_of_calibration_is_not_judged() -> None:
    """The rule: a set in a dtype with more than NOT_JUDGED_SHARE of its tests skipped for
    want of calibration is not judged, and the run with it; at or below it, a note only."""
    passed = [DriftRecord(test_id=_layer("a", 0), model="a", suite="models")]
    mostly = passed + [_skipped(_layer("a", i), "a") for i in range(1, 4)]  # 3 of 4
    verdict = judge_run(mostly, {"passed": 1, "skipped": 3})
    assert verdict.verdict == "not judged" and verdict.label == "NOT JUDGED"
    assert verdict.notes == [
        "NOT JUDGED: a bfloat16: 3 of 4 tests skipped for want of calibration (its golden set "
        "has none in bfloat16: captured with --calibrate '' or without bfloat16); capture it "
        "again with --calibrate bfloat16"
    ]
    # half is not more than half (NOT_JUDGED_SHARE is 0.5): judged, and the skip noted
    assert NOT_JUDGED_SHARE == 0.5
    half = [*passed, _skipped(_layer("a", 1), "a")]
    verdict = judge_run(half, {"passed": 1, "skipped": 1})
    assert verdict.verdict == "passed" and verdict.notes[0].startswith("a bfloat16: 1 of 2")
    # a failure still reads as one
    failed = [r.with_fields(verdict="failed") for r in passed] + mostly[1:]
    assert judge_run(failed, {"failed": 1, "skipped": 3}).verdict == "failed"


def test_an_uncalibrated_skip_leaves_a_record_that_says_so() -> None:
    from numalign.compare.model_verdict import Uncalibrated
    from numalign.records.outcomes import outcome_for

    test_id = "suites/models/test_layers.py::test_layer[bare/model.layers.0.mlp-bfloat16]"
    outcome = outcome_for(Uncalibrated("model.layers.0.mlp: no calibration"), test_id, tp=1)
    assert outcome is not None and outcome.ending == "skip" and outcome.record is not None
    record = outcome.record
    assert (record.verdict, record.rule, record.model, record.tp) == (
        "skipped", UNCALIBRATED, "bare", 1,
    )  # fmt: skip


ROOT = Path(__file__).resolve().parents[2]


def test_a_replay_of_a_set_captured_without_calibration_reads_not_judged(
    pytester: pytest.Pytester, on_path: None
) -> None:
    """Issue 42, item 13: a set captured with ``--calibrate ''`` replayed as PASSED (its
    tests skipped for want of calibration, its mask test passed exactly). Now the skips are
    records of rule ``uncalibrated``; summary.json, drift.html and the terminal say NOT
    JUDGED, and the session is not green."""
    from numalign.golden.capture_spec import CaptureSpec
    from numalign.replay.ensemble import capture_calibrated

    sets = pytester.path / "sets"
    spec = CaptureSpec(progress=False, continuation=2, decode_steps=0)
    capture_calibrated(ROOT / "golden" / "models" / "tiny-llama", sets / "bare-llama", spec,
                       calibrate=())  # fmt: skip
    suites = ROOT / "suites" / "models"
    result = pytester.runpytest_subprocess(
        str(suites / "test_layers.py"), str(suites / "test_model.py"), "--rootdir", str(ROOT),
        "-p", "no:cacheprovider", "--report-dir", str(pytester.path / "reports"), "-q",
        "--golden", str(sets), "--dtype", "bfloat16", "-k", "bare-llama",
    )  # fmt: skip
    result.assert_outcomes(passed=1, skipped=16)  # the mask point alone is judged (exactly)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*numalign: NOT JUDGED: bare-llama bfloat16: 16 of 17 tests skipped for want of "
        "calibration*--calibrate bfloat16"
    ])  # fmt: skip
    run = (pytester.path / "reports" / "latest").resolve()
    skipped = {r.test_id for r in read_records(run) if r.rule == UNCALIBRATED}
    assert len(skipped) == 16
    assert _strict((run / "summary.json").read_text())["verdict"] == "not judged"
    html = (run / "drift.html").read_text()
    assert "NOT JUDGED: 17 tests: 16 skipped, 1 passed" in html and "PASSED:" not in html
