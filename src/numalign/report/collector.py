"""The controller-side session object: writes records as test reports arrive, and the
session file (``report.session``) with the first record and at the end, then the tables, and
names what it wrote, and the run's verdict where it is not a plain pass or fail, in the
terminal summary."""

from __future__ import annotations

import errno
import json
import os
import platform
from pathlib import Path
from typing import Any

import pytest

from numalign.compare.policy import load_policy
from numalign.records.drift import (
    FAILING,
    DriftRecord,
    RecordWriter,
    count_outcomes,
    crashed_record,
    error_record,
    new_run_id,
    pytest_outcome,
    read_records,
    records_of,
    write_records,
)
from numalign.report.baseline import BaselineDiff
from numalign.report.history import HISTORY_FILE
from numalign.report.ratchet import ratchet_lines
from numalign.report.retention import prune_runs
from numalign.report.run import render_run
from numalign.report.session import write_session
from numalign.report.tables import power_by_dtype, power_lines
from numalign.report.verdict import RunVerdict
from numalign.session.settings import Settings

#: How many of the worst records the terminal summary names.
WORST_SHOWN = 5


def _failure_line(run_dir: Path, exc: BaseException) -> str:
    """What went wrong writing a run's report, and how to finish it, as one line."""
    what = "free space on that disk" if getattr(exc, "errno", None) == errno.ENOSPC else "fix it"
    return (
        f"numalign: the report of {run_dir} is incomplete: {type(exc).__name__}: {exc}; "
        f"{what}, then rebuild it with: numalign report {run_dir}"
    )


def _unwritable(record: DriftRecord, exc: BaseException) -> DriftRecord:
    """The ``error`` record that stands for a record JSON has no form for (a field holding
    an object, not a number or a string)."""
    why = f"its drift record could not be written as JSON: {type(exc).__name__}: {exc}"
    return error_record(record.test_id, type(exc).__name__, why)


class DriftCollector:
    """Created on the xdist controller (or a plain session) only; kept in ``config.stash``."""

    def __init__(self, settings: Settings, run_id: str | None = None) -> None:
        self.settings = settings
        self.run_id = run_id or new_run_id()
        self.run_dir = settings.report_dir / self.run_id
        self.writer = RecordWriter(self.run_dir / "records.jsonl")
        self.outcomes: dict[str, str] = {}
        #: Every counted report's outcome, as pytest's terminal counts them (a test whose
        #: call passed and whose teardown failed counts once passed and once error).
        self.counted: list[str] = []
        self.written: list[Path] = []
        self.records: list[DriftRecord] = []
        self.diff: BaselineDiff | None = None
        self.pruned: list[Path] = []
        #: records not written yet (the disk failed): written whole at the session's end
        self.unwritten: list[DriftRecord] = []
        #: what went wrong writing the run, as one line for the closing summary
        self.failure: str | None = None
        #: tests selected (None: not known yet), tests that handed records, records received
        self.selected: int | None = None
        self.recorded_tests: set[str] = set()
        self.received = 0
        #: the session file as last written (None: no record arrived yet)
        self.session: dict[str, Any] | None = None
        self.verdict: RunVerdict | None = None

    def release(self) -> None:
        """Drops the records held for the closing summary, once it is written (the
        session's end: ``plugin.release_records``); what was written stays on disk."""
        self.records = []
        self.unwritten = []

    # -- pytest hooks -------------------------------------------------------------------------
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.selected = max(self.selected or 0, len(session.items))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        """Under xdist the workers collect: each worker collects the whole selection."""
        self.selected = max(self.selected or 0, len(ids))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        outcome = pytest_outcome(report)
        if outcome is not None:
            self.counted.append(outcome)
        if outcome == "crashed":  # xdist's report for a test whose worker died
            record = crashed_record(report.nodeid, str(report.longrepr))
            self._write(record.with_fields(outcome="crashed"))
            self.outcomes[report.nodeid] = "crashed"
            return
        # every phase's report carries the test's user properties so far: records are read
        # from the call, or from a setup that failed (there is no call then); each carries
        # the test's outcome as pytest counts it, and an expected failure's reason
        reason = getattr(report, "wasxfail", None) or None
        if report.when == "call" or (report.when == "setup" and not report.passed):
            for record in records_of(report.user_properties):
                self._write(record.with_fields(outcome=outcome, xfail_reason=reason))
        if outcome is not None and report.when in ("setup", "call"):
            self.outcomes[report.nodeid] = outcome

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        try:
            if self.session is not None:  # before the records: a full disk keeps what it says
                self._write_session(finished=True)
            self._finish_records()
            if self.writer.count == 0:  # no numalign comparison ran: write nothing
                return
            self._render(session)
        except (OSError, ValueError) as exc:  # a full disk, a baseline gone meanwhile, ...
            self.failure = self.failure or _failure_line(self.run_dir, exc)
        # a run that lost records or judged little is not green (its notes say why)
        unsure = self.verdict is not None and self.verdict.verdict in ("incomplete", "not judged")
        if (self.failure or unsure) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _write(self, record: DriftRecord) -> None:
        """Writes a record as it arrives; after the disk failed once, keeps it (and every
        later one) for ``_finish_records``: a record is never lost to a full disk. The first
        record writes the session file; a record that is not JSON (a field holding an object
        JSON has no form for) is written as an ``error`` record saying so."""
        self.recorded_tests.add(record.test_id)
        self.received += 1
        if self.session is None:
            self._write_session(finished=False)
        if not self.unwritten:
            try:
                try:
                    self.writer.write(record)
                except (TypeError, ValueError) as exc:  # nothing of it was written
                    record = _unwritable(record, exc)
                    self.writer.write(record)
                return
            except OSError as exc:
                self.failure = _failure_line(self.run_dir, exc)
        try:
            json.dumps(record.to_json(), allow_nan=False)
        except (TypeError, ValueError) as exc:
            record = _unwritable(record, exc)
        self.unwritten.append(record)

    def _write_session(self, *, finished: bool) -> None:
        """Writes the session file (``report.session``); a failure is the run's failure."""
        self.session = self.header() | {"selected": self.selected, "finished": finished}
        if finished:
            self.session |= {"tests": count_outcomes(self.counted),
                             "tests_recorded": len(self.recorded_tests),
                             "records": self.received}  # fmt: skip
        try:
            write_session(self.run_dir, self.session)
        except OSError as exc:
            self.failure = self.failure or _failure_line(self.run_dir, exc)

    def _finish_records(self) -> None:
        """Closes records.jsonl; where writes failed, rewrites it whole (atomically: the
        records written before, a cut last line dropped, and the kept ones)."""
        try:
            self.writer.close()
        except OSError as exc:
            self.failure = self.failure or _failure_line(self.run_dir, exc)
        if not self.unwritten:
            return
        path = self.writer.path
        before = read_records(path) if path.is_file() else []
        path.parent.mkdir(parents=True, exist_ok=True)
        write_records(path, [*before, *self.unwritten])
        self.writer.count = len(before) + len(self.unwritten)
        self.unwritten = []

    def _render(self, session: pytest.Session) -> None:
        settings = self.settings
        history = settings.history or settings.report_dir / HISTORY_FILE
        # an interrupted run (Ctrl-C, a CI timeout's SIGINT) is reported, marked as such, but
        # neither enters the history nor becomes ``latest``: it did not run what it selected
        interrupted = session.exitstatus == pytest.ExitCode.INTERRUPTED
        header = self.header() | {"tests": count_outcomes(self.counted)}
        rendered = render_run(
            self.run_dir,
            header=header | ({"interrupted": True} if interrupted else {}),
            baseline=settings.baseline,
            factor=settings.regression_factor,
            history=history,
            append=not interrupted,
            thresholds=load_policy(session.config.rootpath / "pyproject.toml").thresholds,
            session=self.session,
        )
        self.records = rendered.records
        self.verdict = rendered.verdict
        self.written = [self.writer.path, *rendered.written]
        self.diff = rendered.diff
        if not interrupted:
            self._point_latest()
        baseline = settings.baseline
        if baseline is not None and baseline.is_file():
            baseline = baseline.parent
        self.pruned = prune_runs(settings.report_dir, settings.keep_runs, [baseline, self.run_dir])
        if self.diff and self.diff.regressed and settings.fail_on_regression:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.failure:
            terminalreporter.write_line(self.failure, red=True)
        if not self.written:
            return
        tr = terminalreporter
        tr.write_sep("-", "numalign drift")
        # the worst of the tests pytest counted: an expected failure's records, failed or
        # not, are named with it below
        counted = [r for r in self.records if r.outcome != "xfailed" and r.status != "xfailed"]
        worst = sorted(
            (r for r in counted if r.used is not None),
            key=lambda r: (r.status not in FAILING, -(r.used or 0.0)),
        )[:WORST_SHOWN]
        for record in worst:  # a NaN use is ranked as infinite, and printed as it is
            used = record.budget_used if isinstance(record.budget_used, float) else record.used
            tr.write_line(f"{used:8.3g} of budget  {record.status:<7} {record.test_id}")
        expected = {r.test_id: r.xfail_reason for r in self.records if r.status == "xfailed"}
        for test_id, why in list(expected.items())[:WORST_SHOWN]:
            tr.write_line(f"expected failure  {test_id}: {(why or 'xfail').splitlines()[0]}")
        tests = outcome_line(count_outcomes(self.counted), "tests")
        records = outcome_line(count_outcomes(r.status for r in self.records), "records")
        tr.write_line(f"numalign: {tests}; {records}")
        for line in power_lines(power_by_dtype(self.records)):
            tr.write_line(f"numalign: {line}")
        for note in self.verdict.notes if self.verdict else []:
            tr.write_line(f"numalign: {note}", yellow=True)
        if self.diff is not None:
            tr.write_line(
                f"numalign: {len(self.diff.regressed)} regression(s) against "
                f"{self.settings.baseline} ({len(self.diff.new)} new, "
                f"{len(self.diff.vanished)} vanished records)"
            )
            for item in self.diff.regressed[:WORST_SHOWN]:
                growth = f"{item['growth']:.3g}x" if item["growth"] else "newly failing"
                tr.write_line(f"  regressed {growth:>10}  {item['test_id']}")
            moved = bool(self.diff.loosened or self.diff.weakened)
            line, *rows = ratchet_lines(self.diff.to_dict(), WORST_SHOWN)
            tr.write_line(f"numalign: {line}", yellow=moved)
            for row in rows:
                tr.write_line(row)
        if self.pruned:
            tr.write_line(
                f"numalign: removed {len(self.pruned)} old run(s) of {self.settings.report_dir} "
                f"(--keep-runs {self.settings.keep_runs})"
            )
        tr.write_line(
            f"numalign: {self.writer.count} drift records; report: {self.run_dir / 'drift.html'}"
        )

    # -- helpers ------------------------------------------------------------------------------
    def header(self) -> dict[str, Any]:
        versions: dict[str, str] = {}
        for module in ("torch", "transformers", "numalign"):
            try:
                versions[module] = __import__(module).__version__
            except Exception:  # not installed, or not importable here
                versions[module] = "n/a"
        return {
            "run_id": self.run_id,
            "device": self.settings.device,  # replaced by the devices the records name
            "dtypes": list(self.settings.dtypes),
            "tier": self.settings.tier,
            "versions": versions,
            "host": platform.node(),
            "python": platform.python_version(),
        }

    def _point_latest(self) -> None:
        latest = self.settings.report_dir / "latest"
        tmp = self.settings.report_dir / f".latest-{os.getpid()}"
        try:
            if tmp.is_symlink() or tmp.exists():
                tmp.unlink()
            tmp.symlink_to(self.run_id, target_is_directory=True)
            tmp.replace(latest)
        except OSError:  # file systems without symlinks: a text pointer instead
            (self.settings.report_dir / "LATEST").write_text(self.run_id + "\n", encoding="utf-8")


def outcome_line(counts: dict[str, int], what: str) -> str:
    """``"5 tests: 4 failed, 1 xfailed"``: counts in OUTCOMES' order, as pytest words them
    (pytest counts a crashed test among the failed)."""
    total = sum(counts.values())
    parts = ", ".join(f"{n} {o}" for o, n in counts.items())
    return f"{total} {what}: {parts or 'none'}"
