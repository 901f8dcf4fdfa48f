"""Machine-readable tables of a run: drift.csv (drift.parquet with pyarrow), summary.json
(with ``power``: per dtype, what the passes were able to see, ``power_by_dtype``)."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.core import finite_json
from numalign.records.drift import DriftRecord, count_outcomes
from numalign.report.atomic import write_atomic, write_text_atomic

if TYPE_CHECKING:
    import pandas as pd

#: Metric columns flattened into the drift table.
METRIC_COLUMNS: tuple[str, ...] = (
    "max_abs",
    "max_rel",
    "mean_abs",
    "rmse",
    "rel_l2",
    "cosine",
    "ulp_max",
    "ulp_p99",
    "mismatch_fraction",
    "nan_actual",
    "inf_actual",
    "norm_ratio",
)
TABLE_COLUMNS: tuple[str, ...] = (
    "test_id",
    "suite",
    "point",
    "candidate",
    "device",
    "dtype",
    "case",
    "model",
    "mode",
    "request",
    "output",
    "step",
    "verdict",
    "outcome",
    "xfail_reason",
    "rule",
    "budget_used",
    "duration_s",
    "compile_s",
    "graph_breaks",
    "swap",
    "golden_fingerprint",
    *METRIC_COLUMNS,
    "detectable_scale",
    "detectable_bias",
    "reason",
    "error",
)


#: Columns not read off the record's own fields: its metrics, and its power (``detectable``).
DERIVED = frozenset({*METRIC_COLUMNS, "detectable_scale", "detectable_bias"})


def records_frame(records: list[DriftRecord]) -> pd.DataFrame:
    """One row per record, metrics flattened into columns."""
    import pandas as pd

    rows = []
    for record in records:
        row = {key: getattr(record, key) for key in TABLE_COLUMNS if key not in DERIVED}
        row.update({key: record.metrics.get(key) for key in METRIC_COLUMNS})
        found = record.detectable if isinstance(record.detectable, dict) else {}
        row.update({f"detectable_{kind}": found.get(kind) for kind in ("scale", "bias")})
        rows.append(row)
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def summarize(
    records: list[DriftRecord], outcomes: dict[str, str], header: dict[str, Any]
) -> dict[str, Any]:
    """Counts of tests per outcome as pytest counts them (``header["tests"]``, the
    controller's count, where it has one: it includes tests that left no record; else per
    test id from the records), of records per status (``DriftRecord.status``: an expected
    failure's records are ``xfailed``), per (suite, dtype of the test, status), and the
    expected failures with their reasons."""
    per_group: Counter[tuple[str, str, str]] = Counter()
    worst: dict[str, float] = {}
    expected: dict[str, str] = {}
    for record in records:
        per_group[(str(record.suite), str(record.test_dtype), record.status)] += 1
        if record.status == "xfailed":
            expected.setdefault(record.test_id, record.xfail_reason or "")
        if record.used is not None and record.status != "xfailed":
            suite = str(record.suite)
            worst[suite] = max(worst.get(suite, 0.0), record.used)
    return {
        **header,
        "tests": header.get("tests") or count_outcomes(outcomes.values()),
        "records": len(records),
        "records_by_status": count_outcomes(r.status for r in records),
        "by_suite_dtype": [
            {"suite": s, "dtype": d, "verdict": v, "count": n}
            for (s, d, v), n in sorted(per_group.items())
        ],
        "expected_failures": [{"test_id": t, "reason": r} for t, r in sorted(expected.items())],
        "worst_budget_used": worst,
        "power": power_by_dtype(records),
    }


def power_by_dtype(records: list[DriftRecord]) -> dict[str, dict[str, Any]]:
    """Per dtype of the test, what its passed verdicts were able to see (``detectable``,
    ``compare.power``): the median and the worst (largest) smallest-caught scale and bias
    (in the truth's RMS) over its passed records that have one, and how many they are.
    An infinite worst says some pass could not have caught that error at all."""
    values: dict[str, dict[str, list[float]]] = {}
    for record in records:
        found = record.detectable
        if record.status != "passed" or not isinstance(found, dict):
            continue
        kinds = values.setdefault(str(record.test_dtype), {"scale": [], "bias": []})
        for kind, seen in kinds.items():
            value = found.get(kind)
            if isinstance(value, (int, float)) and not math.isnan(value):
                seen.append(float(value))
    out: dict[str, dict[str, Any]] = {}
    for dtype in sorted(values):
        kinds = values[dtype]
        out[dtype] = {"records": max(len(v) for v in kinds.values())} | {
            kind: {"median": statistics.median(seen), "worst": max(seen)}
            for kind, seen in kinds.items()
            if seen
        }
    return out


def power_lines(power: dict[str, dict[str, Any]]) -> list[str]:
    """One line per dtype of ``power_by_dtype``, as the terminal summary prints it."""
    lines = []
    for dtype, figures in power.items():
        parts = [
            f"a {kind} of {_figure(f['median'])} (median), {_figure(f['worst'])} (worst)"
            + (" of the RMS" if kind == "bias" else "")
            for kind in ("scale", "bias")
            if (f := figures.get(kind))
        ]
        if parts:
            lines.append(
                f"power {dtype}: {'; '.join(parts)}, the smallest each pass would have "
                f"caught ({figures['records']} passed records)"
            )
    return lines


def _figure(value: float) -> str:
    return f"{value:.2g}" if math.isfinite(value) else "inf"


def write_tables(run_dir: Path, records: list[DriftRecord], summary: dict[str, Any]) -> list[Path]:
    """Writes drift.csv (and drift.parquet when pyarrow is installed) and summary.json, each
    atomically (``atomic.write_atomic``)."""
    frame = records_frame(records)
    written = [run_dir / "drift.csv", run_dir / "summary.json"]
    write_atomic(written[0], lambda tmp: frame.to_csv(tmp, index=False))
    write_text_atomic(written[1], finite_json.dumps(summary, indent=2) + "\n")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        pass
    else:
        write_atomic(run_dir / "drift.parquet", lambda tmp: frame.to_parquet(tmp, index=False))
        written.append(run_dir / "drift.parquet")
    return written
