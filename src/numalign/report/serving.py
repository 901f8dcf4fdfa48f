"""drift.html's serving matrix: per model and dtype, each serving arrangement a serving engine
served the golden rows in (``--serving``), its verdict, its worst use of budget, and why it
was skipped (an arrangement the set cannot exercise says what the set lacks)."""

from __future__ import annotations

from typing import Any

from numalign.records import testids
from numalign.records.drift import STATUSES, DriftRecord
from numalign.runtime.serving import ARRANGEMENTS, DEFAULT_SERVING

#: A cell's verdict, worst first: the records' own order (``record.STATUSES``), except that
#: a skipped record (a point the engine has no module for) never outranks a judged one.
WORST_FIRST = (*(s for s in STATUSES if s != "skipped"), "skipped")


def serving_matrix(records: list[DriftRecord]) -> dict[str, Any] | None:
    """The matrix of the run's model and decode records by model, dtype and arrangement; None
    where the run served no arrangement but the default (nothing to compare)."""
    cells: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    served: set[str] = set()
    for r in records:
        if r.suite != "models" or r.candidate in (None, "transformers"):
            continue
        parsed = testids.parse(r.test_id)
        if parsed.function not in ("test_model", "test_decode"):
            continue
        name = parsed.serving or DEFAULT_SERVING
        served.add(name)
        row = cells.setdefault((str(r.model), str(r.dtype)), {})
        cell = row.setdefault(name, {"verdict": "skipped", "used": None, "reason": None})
        status = r.status
        if WORST_FIRST.index(status) < WORST_FIRST.index(cell["verdict"]):
            cell["verdict"] = status
        if r.budget_used is not None and r.verdict != "skipped":
            cell["used"] = max(cell["used"] or 0.0, float(r.budget_used))
        if status == "skipped" and cell["reason"] is None and r.reason:
            cell["reason"] = r.reason
    if served <= {DEFAULT_SERVING}:
        return None
    for row in cells.values():  # a reason for a skipped arrangement only
        for cell in row.values():
            if cell["verdict"] != "skipped":
                cell["reason"] = None
    columns = [name for name in ARRANGEMENTS if name in served]
    rows = [
        {"model": model, "dtype": dtype,
         "cells": [cells[(model, dtype)].get(name) for name in columns]}
        for model, dtype in sorted(cells)
    ]  # fmt: skip
    return {"columns": columns, "rows": rows}
