"""Compiled against eager, side by side: the drift of a ``--compile`` run next to an eager
run of the same tests.

One run is either eager or compiled (``--compile`` holds for the session), and the two runs
of a test share their record keys, so they meet the way a baseline does: run one with
``--drift-baseline`` the other (``pytest suites --compile --drift-baseline reports/<eager>``,
or offline ``numalign report <compiled> --baseline <eager>``; either may be the baseline).
Records are matched by key; per suite, operator or model, dtype and mode the section shows
the worst use of budget of each side, the ratio, the failures of each side and the worst
point, plus the compile time and run time of each side. A compiled run without an eager
one still gets its compile time and graph breaks.
"""

from __future__ import annotations

import math
from typing import Any

from numalign.records.drift import DriftRecord
from numalign.runtime.compiled import CompileSpec

#: What marks a compiled variant in a record's ``swap`` (``compile=inductor``).
COMPILE_PREFIX = "compile="
#: The first record schema whose variant is in structured fields (``compile_backend``).
STRUCTURED_SCHEMA = 3


def compile_label(record: DriftRecord) -> str | None:
    """The record's compile variant as labels name it (``compile=inductor:max-autotune``),
    or None where it ran eager: from its ``compile_backend`` and ``compile_mode``; for a
    record of schema 1 or 2, read from its ``swap`` (:func:`compile_label_of_swap`)."""
    if record.schema < STRUCTURED_SCHEMA:
        return compile_label_of_swap(record.swap)
    if record.compile_backend is None:
        return None
    return CompileSpec(record.compile_backend, record.compile_mode).label


def compile_label_of_swap(swap: str | None) -> str | None:
    """The old-schema reader: the compile part of a variant label as records of schema 1
    and 2 carry it in ``swap`` (``rms_norm=fused,compile=inductor:max-autotune``), or None.
    Records of schema 3 name their compile variant in fields: read those."""
    return next((p for p in (swap or "").split(",") if p.startswith(COMPILE_PREFIX)), None)


def _cost(records: list[DriftRecord]) -> dict[str, float]:
    """Compile and run seconds over the tests of ``records`` (a test's records repeat its
    ``compile_s`` and ``duration_s``: counted once per test), and graph breaks."""
    compile_s: dict[str, float] = {}
    run_s: dict[str, float] = {}
    breaks: dict[str, int] = {}
    for r in records:
        compile_s[r.test_id] = max(compile_s.get(r.test_id, 0.0), float(r.compile_s or 0.0))
        run_s[r.test_id] = max(run_s.get(r.test_id, 0.0), float(r.duration_s or 0.0))
        breaks[r.test_id] = max(breaks.get(r.test_id, 0), int(r.graph_breaks or 0))
    return {
        "compile_s": sum(compile_s.values()),
        "run_s": sum(run_s.values()),
        "graph_breaks": float(sum(breaks.values())),
        "tests": float(len(run_s)),
    }


def _where(r: DriftRecord) -> tuple[str, str, str, str]:
    """(suite, operator or model, dtype, mode) a row of the comparison aggregates."""
    what = str(r.model) if r.model else (r.point or "?").split(".")[0]
    return str(r.suite), what, str(r.dtype), str(r.mode or "")


def _used(r: DriftRecord) -> float | None:
    used = r.used
    if used is None and r.verdict in ("failed", "error", "crashed"):
        return math.inf
    return used


def side_by_side(current: list[DriftRecord], other: list[DriftRecord]) -> dict[str, Any] | None:
    """The compiled-against-eager comparison of two runs, or None unless exactly one of them
    is compiled. Rows: per (suite, operator or model, dtype, mode), the worst use of budget
    eager and compiled over the records both runs hold, failures on each side, and the point
    whose use grew most."""
    now = [compile_label(r) for r in current if r.verdict != "skipped"]
    then = [compile_label(r) for r in other if r.verdict != "skipped"]
    if any(now) == any(then):
        return None
    compiled, eager = (current, other) if any(now) else (other, current)
    labels = sorted({label for label in (now if any(now) else then) if label})
    by_key = {r.key: r for r in eager if r.verdict != "skipped"}
    rows: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for r in compiled:
        base = by_key.get(r.key)
        if r.verdict == "skipped" or base is None:
            continue
        row = rows.setdefault(
            _where(r),
            {"eager": 0.0, "compiled": 0.0, "eager_failed": 0, "compiled_failed": 0,
             "records": 0, "worst_point": None, "worst_growth": 0.0},
        )  # fmt: skip
        used, base_used = _used(r), _used(base)
        row["records"] += 1
        row["compiled"] = max(row["compiled"], used or 0.0)
        row["eager"] = max(row["eager"], base_used or 0.0)
        row["compiled_failed"] += r.verdict != "passed"
        row["eager_failed"] += base.verdict != "passed"
        growth = (used or 0.0) - (base_used or 0.0)
        if growth > row["worst_growth"]:
            row["worst_growth"], row["worst_point"] = growth, r.point
    table = []
    for (suite, what, dtype, mode), row in sorted(rows.items()):
        eager_used, compiled_used = row["eager"], row["compiled"]
        ratio = compiled_used / eager_used if eager_used and math.isfinite(eager_used) else None
        table.append({"suite": suite, "what": what, "dtype": dtype, "mode": mode,
                      "ratio": ratio, **row})  # fmt: skip
    return {
        "labels": labels,
        "rows": table,
        "compiled_cost": _cost(compiled),
        "eager_cost": _cost(eager),
        "compiled_is_current": any(now),
    }


def compiled_cost(records: list[DriftRecord]) -> dict[str, Any] | None:
    """A compiled run's own cost (labels, compile and run seconds, graph breaks), or None
    for an eager run."""
    labels = sorted({label for r in records if (label := compile_label(r))})
    if not labels:
        return None
    return {"labels": labels, **_cost([r for r in records if compile_label(r)])}
