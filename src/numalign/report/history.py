"""Run history: one JSON line per run, appended at the end of each session, for trends."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from numalign.core import finite_json
from numalign.records.drift import DriftRecord

#: The history file's name inside the report folder when --history does not name one.
HISTORY_FILE = "history.jsonl"


def history_entry(records: list[DriftRecord], summary: dict[str, Any]) -> dict[str, Any]:
    """The run's line: its header and counts, and the worst budget use per suite and group."""
    worst: dict[str, dict[str, float]] = defaultdict(dict)
    for record in records:
        if record.used is not None:
            suite, group = str(record.suite), record.group
            worst[suite][group] = max(worst[suite].get(group, 0.0), record.used)
    keep = ("run_id", "device", "dtypes", "tier", "versions", "tests", "records")
    return {**{k: summary.get(k) for k in keep}, "worst_budget_used": worst}


def append_history(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(finite_json.dumps(entry) + "\n")


def read_history(path: Path) -> list[dict[str, Any]]:
    """The runs of a history file, oldest first (non-finite numbers read back as floats); a
    missing file is an empty history."""
    if not path.is_file():
        return []
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                entries.append(finite_json.decode(json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a history entry ({exc})") from None
    return entries
