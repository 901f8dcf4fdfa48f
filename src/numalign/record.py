"""Drift records: one per comparison, collected on the xdist controller.

Tests hand records to pytest as user properties (key ``numalign.drift``), so they travel to
the controller with each test report. The controller appends them to
``<report-dir>/<run-id>/records.jsonl`` as reports arrive, flushed, so a crashed worker or a
killed session still leaves every record received so far. A test whose worker crashed gets a
record with verdict "crashed".
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from numalign.compare import CompareResult

#: Version of the record schema; bump it when a field changes meaning or goes away.
SCHEMA_VERSION = 1
USER_PROPERTY = "numalign.drift"

#: Fields of a record, in the order the tables show them.
FIELDS: tuple[str, ...] = (
    "schema",
    "test_id",
    "suite",
    "point",
    "candidate",
    "device",
    "dtype",
    "case",
    "shape",
    "verdict",
    "rule",
    "reason",
    "budget_used",
    "duration_s",
    "golden_fingerprint",
    "swap",
    "metrics",
    "budget",
    "message",
)


def make_record(
    result: CompareResult,
    *,
    test_id: str,
    suite: str,
    candidate: str,
    device: str,
    case: str,
    duration_s: float | None = None,
    golden_fingerprint: str | None = None,
    swap: str | None = None,
    **suite_fields: Any,
) -> dict[str, Any]:
    """The drift record of one comparison (JSON-ready: non-finite numbers are null).
    ``suite_fields`` are a suite's own (model suites: model, mode, point_index,
    first_divergence)."""
    data = result.to_dict()
    record = {
        "schema": SCHEMA_VERSION,
        "test_id": test_id,
        "suite": suite,
        "point": result.name,
        "candidate": candidate,
        "device": device,
        "dtype": result.dtype,
        "case": case,
        "shape": data["shape"],
        "verdict": "passed" if result.passed else "failed",
        "rule": result.rule,
        "reason": result.reason,
        "budget_used": data["budget_used"],
        "duration_s": duration_s,
        "golden_fingerprint": golden_fingerprint,
        "swap": swap,
        "metrics": data["metrics"],
        "budget": data["budget"],
        "message": None if result.passed else result.message(),
    }
    return record | suite_fields


def crashed_record(test_id: str, message: str) -> dict[str, Any]:
    """The record of a test whose worker died while running it."""
    return {field: None for field in FIELDS} | {
        "schema": SCHEMA_VERSION,
        "test_id": test_id,
        "verdict": "crashed",
        "rule": "crashed",
        "reason": "the worker process died while running this test",
        "message": message,
    }


def record_key(record: dict[str, Any]) -> str:
    """A stable key to match records across runs: test id and compared point."""
    return f"{record['test_id']}::{record.get('point') or ''}"


@dataclass
class RecordWriter:
    """Appends records to a JSON-lines file, one flushed line per record; the file (and its
    folder) appear with the first record."""

    path: Path
    count: int = 0
    _fh: IO[str] | None = None

    def open(self) -> RecordWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")
        return self

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            self.open()
        assert self._fh is not None
        self._fh.write(json.dumps(record, allow_nan=False, sort_keys=False) + "\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of a run folder or a records.jsonl file. A last line cut by a crash is
    skipped; any other unreadable line is an error naming the file and line."""
    file = Path(path)
    if file.is_dir():
        file = file / "records.jsonl"
    if not file.is_file():
        raise FileNotFoundError(
            f"no records at {path}: expected a run folder holding records.jsonl, or the file"
        )
    return list(_parse(file, file.read_text(encoding="utf-8").splitlines()))


def _parse(file: Path, lines: list[str]) -> Iterator[dict[str, Any]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):  # the line being written when the session died
                return
            raise ValueError(f"{file}:{number}: not a JSON record ({exc})") from None


def new_run_id(now: float | None = None) -> str:
    """A sortable run id: UTC time to the second plus the process id."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    return f"{stamp}-{os.getpid()}"


def merge_records(runs: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Records of several runs; a key seen twice keeps the later run's record."""
    merged: dict[str, dict[str, Any]] = {}
    for records in runs:
        for record in records:
            merged[record_key(record)] = record
    return list(merged.values())


class NodeRecorder:
    """Hands records of one test to pytest as user properties (the ``record_drift``
    fixture): ``record_drift(result, suite=..., candidate=..., device=..., case=...)``."""

    def __init__(
        self,
        nodeid: str,
        user_properties: list[tuple[str, object]],
        on_record: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.nodeid = nodeid
        self.user_properties = user_properties
        self.on_record = on_record

    def __call__(self, result: CompareResult, **context: Any) -> dict[str, Any]:
        return self._add(make_record(result, test_id=self.nodeid, **context))

    def _add(self, record: dict[str, Any]) -> dict[str, Any]:
        self.user_properties.append((USER_PROPERTY, record))
        if self.on_record is not None:
            self.on_record(record)
        return record

    def skipped(self, reason: str, **context: Any) -> dict[str, Any]:
        """Records a comparison that cannot run here (so summaries count it per dtype)."""
        record = {field: None for field in FIELDS} | context
        record |= {"schema": SCHEMA_VERSION, "test_id": self.nodeid, "verdict": "skipped",
                   "rule": "skipped", "reason": reason}  # fmt: skip
        return self._add(record)
