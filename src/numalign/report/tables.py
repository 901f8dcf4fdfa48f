"""Machine-readable tables of a run: drift.csv (drift.parquet with pyarrow), summary.json."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign import finite_json
from numalign.record import DriftRecord, count_outcomes
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
    "reason",
    "error",
)


def records_frame(records: list[DriftRecord]) -> pd.DataFrame:
    """One row per record, metrics flattened into columns."""
    import pandas as pd

    rows = []
    for record in records:
        row = {key: getattr(record, key) for key in TABLE_COLUMNS if key not in METRIC_COLUMNS}
        row.update({key: record.metrics.get(key) for key in METRIC_COLUMNS})
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
    }


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
