"""Reports survive a full disk and errors at the session's end: the session
runs every test, writes what it can, says in one line what to free or fix, and ``numalign
report`` rebuilds the rest; no file is left torn."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from numalign.records.drift import RecordWriter, read_records

COMPARISONS = """
import pytest
import torch
from numalign.compare import CompareSpec, compare

@pytest.mark.parametrize("i", range(10))
def test_compare(i, record_drift):
    t = torch.full((8,), float(i), dtype=torch.float64)
    record_drift(compare(t.float(), t, CompareSpec(name=f"p{i}")), suite="operators", candidate="c",
                 device="cpu", case=str(i))
"""


def _full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def _run(pytester: pytest.Pytester) -> pytest.RunResult:
    pytester.makepyfile(COMPARISONS)
    return pytester.runpytest("--report-dir", "out", "-p", "no:cacheprovider")


def test_a_disk_full_during_the_run_loses_no_record_and_no_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = RecordWriter.write
    calls = []

    def filling(self: RecordWriter, record: object) -> None:
        calls.append(record)
        if 3 <= len(calls) <= 5:  # full for three records, then space is freed
            raise _full()
        real(self, record)  # type: ignore[arg-type]

    monkeypatch.setattr(RecordWriter, "write", filling)
    result = _run(pytester)
    result.assert_outcomes(passed=10)  # no INTERNALERROR after 2 tests
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # the report was at risk: not green
    result.stdout.fnmatch_lines(["*numalign: the report of *is incomplete: OSError: *No space "
                                 "left on device; free space on that disk, then rebuild it "
                                 "with: numalign report *"])  # fmt: skip
    run = next(p for p in (pytester.path / "out").iterdir() if p.name[0].isdigit())
    assert sorted(int(r.case) for r in read_records(run)) == list(range(10))


def test_a_disk_full_at_the_tables_leaves_no_torn_file_and_report_rebuilds(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pandas

    from numalign.report import render_run

    real = pandas.DataFrame.to_csv

    def torn(self: pandas.DataFrame, path: object, **kwargs: object) -> None:
        Path(str(path)).write_text("suite,operator\noperators,p")  # 100 KB in the issue
        raise _full()

    monkeypatch.setattr(pandas.DataFrame, "to_csv", torn)
    result = _run(pytester)
    result.assert_outcomes(passed=10)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*is incomplete: OSError*free space on that disk*"])
    run = next(p for p in (pytester.path / "out").iterdir() if p.name[0].isdigit())
    assert len(read_records(run)) == 10
    # nothing torn: the records, and the session file (whole: written atomically)
    assert sorted(p.name for p in run.iterdir()) == ["records.jsonl", "session.json"]
    monkeypatch.setattr(pandas.DataFrame, "to_csv", real)  # space freed
    render_run(run)
    assert (run / "drift.html").is_file()
    assert (run / "drift.csv").read_text().count("\n") == 11  # a header and 10 records


def test_an_interrupted_run_is_marked_and_enters_neither_history_nor_latest(
    pytester: pytest.Pytester,
) -> None:
    """Issue 27, item 11: a run stopped midway (Ctrl-C, a CI timeout's SIGINT) entered the
    history and became ``latest`` like a whole one; now it is reported, marked interrupted."""
    import json

    pytester.makepyfile(
        COMPARISONS
        + """

def test_z_interrupt():
    raise KeyboardInterrupt
"""
    )
    whole = pytester.runpytest("--report-dir", "out", "-p", "no:cacheprovider", "-k", "not z_")
    assert whole.ret == 0
    latest = (pytester.path / "out" / "latest").resolve()
    history = (pytester.path / "out" / "history.jsonl").read_text().splitlines()
    # in a subprocess: the interrupt would stop this session too
    cut = pytester.runpytest_subprocess("--report-dir", "out", "-p", "no:cacheprovider")
    assert cut.ret == pytest.ExitCode.INTERRUPTED
    runs = sorted(p for p in (pytester.path / "out").iterdir() if p.is_dir() and p.name != "latest")
    assert len(runs) == 2
    interrupted = next(p for p in runs if p.resolve() != latest)
    assert json.loads((interrupted / "summary.json").read_text())["interrupted"] is True
    assert 'id="interrupted"' in (interrupted / "drift.html").read_text()
    # the whole run stays latest, and the history holds it alone
    assert (pytester.path / "out" / "latest").resolve() == latest
    assert (pytester.path / "out" / "history.jsonl").read_text().splitlines() == history


def test_the_records_leave_the_heap_once_every_report_is_written(
    pytester: pytest.Pytester,
) -> None:
    """At the session's end, every report written, the controller drops the records it held
    (the collector's, and the drift records among the test reports' user properties), so
    pytest's closing garbage collections do not walk them; the records stay on disk."""
    from numalign.plugin import collector_key, release_records
    from numalign.records.drift import USER_PROPERTY

    pytester.makepyfile(COMPARISONS)
    run = pytester.inline_run("--report-dir", "out", "-p", "no:cacheprovider")
    run.assertoutcome(passed=10)
    config = run.getcalls("pytest_sessionfinish")[0].session.config
    reports = [r for r in run.getreports("pytest_runtest_logreport") if r.when == "call"]

    def held() -> int:
        return sum(1 for r in reports for p in r.user_properties if p[0] == USER_PROPERTY)

    # a session run inside another (this one) leaves them to the outer session's end
    assert held() == 10 and len(config.stash[collector_key].records) == 10
    release_records(config)
    assert held() == 0 and config.stash[collector_key].records == []
    assert len(read_records(pytester.path / "out" / "latest")) == 10
