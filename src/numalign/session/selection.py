"""A green run always tested something: the session guard that fails a session whose numalign
suite tests all skipped.

A test of numalign's suites is one carrying a suite marker (``operator``, ``model``,
``layer``, ``decode``); reports reach the xdist controller with their keywords, so the guard
sees every worker's. A session that selected such tests and ran none of them (every one
skipped: a typo'd option value, a device or a model that nothing here can serve) exits with
pytest's "no tests ran" status, 5, and says so with the first skip reasons. Sessions without
numalign suite tests (the project's own tests, a plugin user's unrelated tests) are left
alone; a session where -k or the tier deselected every test already exits 5 (pytest's rule).
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["SUITE_MARKERS", "RanNothingGuard"]

#: Markers of numalign's suite tests.
SUITE_MARKERS = ("operator", "model", "layer", "decode")
#: How many distinct skip reasons the closing line quotes.
_REASONS = 3


class RanNothingGuard:
    """Counts the suite tests that ran and those that skipped; on the controller only."""

    def __init__(self) -> None:
        self.ran = 0
        self.skipped = 0
        self.reasons: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not any(m in report.keywords for m in SUITE_MARKERS):
            return
        if report.skipped and hasattr(report, "wasxfail"):  # an expected failure ran
            self.ran += 1
        elif report.skipped and report.when in ("setup", "call"):
            self.skipped += 1
            reason = _reason(report.longrepr)
            if reason and reason not in self.reasons and len(self.reasons) < _REASONS:
                self.reasons.append(reason)
        elif report.when == "call" or (report.failed and report.when == "setup"):
            self.ran += 1

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.vacuous and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED

    @property
    def vacuous(self) -> bool:
        return self.skipped > 0 and self.ran == 0

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.vacuous:
            return
        why = "; ".join(self.reasons) or "no reason given"
        terminalreporter.write_line(
            f"numalign: {self.skipped} test(s) of numalign's suites selected, none ran (all "
            f"skipped: {why}); nothing was tested: fix the options or the selection",
            red=True,
        )


def _reason(longrepr: Any) -> str:
    """A skip's reason from its report (a (path, line, 'Skipped: reason') tuple)."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ").splitlines()[0][:200]
    return ""
