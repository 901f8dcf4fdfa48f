"""The run's verdict: what drift.html's first line, summary.json's ``verdict``, the terminal
summary and ``numalign report`` say of a whole run. A run reads as passed only where it
failed nothing, its records are whole, and it judged what it selected.

Worst first:

- ``failed``: a test failed, errored, crashed or passed unexpectedly (or a record failed);
- ``incomplete``: the records lack tests or records their session had (``session.json``:
  the disk filled, the file was cut), or the session never wrote its end;
- ``not judged``: a golden set, in a dtype, had more than NOT_JUDGED_SHARE of its tests
  skipped for want of calibration (records of rule ``uncalibrated``): its passes are the few
  outputs judged exactly (masks, indices);
- ``passed``.

Each condition found, whatever the verdict, is a note in words (what, how many, how to fix).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, ClassVar

from numalign.core.errors import UNCALIBRATED
from numalign.records.drift import FAILING, DriftRecord

__all__ = ["NOT_JUDGED_SHARE", "RUN_VERDICTS", "RunVerdict", "judge_run"]

#: Verdicts of a run, worst first.
RUN_VERDICTS: tuple[str, ...] = ("failed", "incomplete", "not judged", "passed")
#: A golden set in one dtype is "not judged" when more than this share of its tests were
#: skipped for want of calibration: its judged tests are then a minority, the exact outputs
#: alone (a set captured with --calibrate '' passes its mask points and skips everything
#: else), and its passes say nothing of the device's numerics. Below it, the set was mostly
#: judged; the skips are still named in a note.
NOT_JUDGED_SHARE = 0.5


@dataclass(frozen=True)
class RunVerdict:
    """A run's verdict (one of RUN_VERDICTS) and the notes that explain it. ``missing``:
    tests and records the session had that the records lack (None: nothing to check, or
    nothing missing); ``uncalibrated``: per set and dtype, tests skipped for want of
    calibration, with ``judged`` False past NOT_JUDGED_SHARE."""

    #: Its keys in summary.json.
    KEYS: ClassVar[tuple[str, ...]] = ("verdict", "verdict_notes", "missing", "uncalibrated")

    verdict: str
    notes: list[str] = field(default_factory=list)
    missing: dict[str, Any] | None = None
    uncalibrated: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The verdict as drift.html and the terminal print it: ``NOT JUDGED``."""
        return self.verdict.upper()

    def to_dict(self) -> dict[str, Any]:
        """summary.json's keys: ``verdict``, ``verdict_notes``, ``missing``,
        ``uncalibrated``."""
        return {"verdict": self.verdict, "verdict_notes": list(self.notes),
                "missing": self.missing, "uncalibrated": self.uncalibrated}  # fmt: skip


def judge_run(
    records: list[DriftRecord], tests: dict[str, int], session: dict[str, Any] | None = None
) -> RunVerdict:
    """The verdict of a run of ``records`` whose tests pytest counted as ``tests`` (per
    outcome), against its ``session`` file (``report.session``; None: not checked)."""
    missing, notes = _missing(records, session)
    uncalibrated = _uncalibrated(records)
    notes += [u["note"] for u in uncalibrated]
    failing = any(tests.get(o, 0) for o in FAILING) or any(r.status in FAILING for r in records)
    if failing:
        verdict = "failed"
    elif missing is not None:
        verdict = "incomplete"
    elif any(not u["judged"] for u in uncalibrated):
        verdict = "not judged"
    else:
        verdict = "passed"
    return RunVerdict(verdict, notes, missing, uncalibrated)


def _missing(
    records: list[DriftRecord], session: dict[str, Any] | None
) -> tuple[dict[str, Any] | None, list[str]]:
    """What the records lack against their session, and the note that says it."""
    if session is None:
        return None, []
    found = len({r.test_id for r in records})
    rebuild = "re-run the tests to judge the rest (numalign report only rebuilds what is there)"
    if not session.get("finished"):
        selected = session.get("selected")
        missing = {"finished": False, "selected": selected, "tests_recorded": found}
        of = f"{selected} tests selected, " if isinstance(selected, int) else ""
        note = (
            f"INCOMPLETE: the session never wrote its end (killed, or its disk filled): "
            f"{of}{found} with records here; {rebuild}"
        )
        return missing, [note]
    tests, records_had = int(session.get("tests_recorded") or 0), int(session.get("records") or 0)
    if found >= tests and len(records) >= records_had:
        return None, []
    missing = {
        "finished": True,
        "tests": max(0, tests - found),
        "of": tests,
        "records": max(0, records_had - len(records)),
        "of_records": records_had,
    }
    note = (
        f"INCOMPLETE: {missing['tests']} of the {tests} tests that handed records have none "
        f"here, {missing['records']} of {records_had} records lost (a full disk, a cut "
        f"file); {rebuild}"
    )
    return missing, [note]


def _uncalibrated(records: list[DriftRecord]) -> list[dict[str, Any]]:
    """Per golden set and dtype with a test skipped for want of calibration: its tests, those
    skipped, whether it was judged, and the note."""
    tests: dict[tuple[str, str], set[str]] = defaultdict(set)
    skipped: dict[tuple[str, str], set[str]] = defaultdict(set)
    for r in records:
        key = (str(r.model or r.point), str(r.test_dtype))
        tests[key].add(r.test_id)
        if r.rule == UNCALIBRATED and r.verdict == "skipped":
            skipped[key].add(r.test_id)
    out = []
    for (model, dtype), ids in sorted(skipped.items()):
        total = len(tests[(model, dtype)])
        judged = len(ids) <= NOT_JUDGED_SHARE * total
        head = f"{model} {dtype}: " if judged else f"NOT JUDGED: {model} {dtype}: "
        note = (
            f"{head}{len(ids)} of {total} tests skipped for want of calibration (its golden "
            f"set has none in {dtype}: captured with --calibrate '' or without {dtype}); "
            f"capture it again with --calibrate {dtype}"
        )
        out.append({"model": model, "dtype": dtype, "skipped": len(ids), "tests": total,
                    "judged": judged, "note": note})  # fmt: skip
    return out
