"""Rendering one run folder: tables, the HTML report, regressions and history. The pytest
controller calls it at the end of a session; ``numalign report`` calls it offline."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from numalign.compare.tolerances import Thresholds
from numalign.core import finite_json
from numalign.records.drift import (
    DriftRecord,
    count_outcomes,
    outcome_of,
    read_records,
    write_records,
)
from numalign.report.atomic import write_text_atomic
from numalign.report.baseline import BaselineDiff, diff_runs
from numalign.report.history import append_history, history_entry, read_history
from numalign.report.html import write_html
from numalign.report.session import SESSION_FILE, merge_sessions, read_session, write_session
from numalign.report.tables import summarize, write_tables
from numalign.report.variants import compiled_cost, side_by_side
from numalign.report.verdict import RunVerdict, judge_run
from numalign.session.option_values import DEFAULT_REGRESSION_FACTOR


def merge_records(runs: Iterable[list[DriftRecord]]) -> list[DriftRecord]:
    """Records of several runs; a key seen twice keeps the later run's record."""
    merged: dict[str, DriftRecord] = {}
    for records in runs:
        for record in records:
            merged[record.key] = record
    return list(merged.values())


@dataclass
class RenderedRun:
    run_dir: Path
    records: list[DriftRecord]
    written: list[Path] = field(default_factory=list)
    diff: BaselineDiff | None = None
    verdict: RunVerdict | None = None


def render_run(
    run_dir: Path,
    *,
    header: dict[str, Any] | None = None,
    baseline: Path | None = None,
    factor: float = DEFAULT_REGRESSION_FACTOR,
    history: Path | None = None,
    append: bool = False,
    thresholds: Thresholds | None = None,
    session: dict[str, Any] | None = None,
) -> RenderedRun:
    """Writes drift.csv (and .parquet), summary.json, regressions.json (with a baseline) and
    drift.html for the records of ``run_dir``; with ``append``, adds the run to ``history``.
    ``thresholds``: the project's (its pyproject.toml), for the baseline diff's noise floor.
    ``session``: what the session knew of itself (``report.session``; None: its session.json,
    where it has one), against which the records are checked whole (``report.verdict``). A
    baseline is read whole (``read_records(whole=True)``): a torn or empty one is an error."""
    records = read_records(run_dir)
    if session is None:
        session = read_session(run_dir)
    if header is None:
        header = _previous_header(run_dir, session)
    devices = sorted({str(r.device) for r in records if r.device})
    if devices:
        header = {**header, "device": ", ".join(devices)}
    rendered = RenderedRun(run_dir=run_dir, records=records)
    summary = summarize(records, outcome_of(records), header)
    rendered.verdict = judge_run(records, dict(summary["tests"]), session)
    summary |= rendered.verdict.to_dict()
    baseline_dict = None
    variants = None  # compiled against eager, where one run of the two is compiled
    if baseline is not None:
        baseline_records = read_records(baseline, whole=True)
        floor = (thresholds or Thresholds()).noise_floor
        rendered.diff = diff_runs(records, baseline_records, factor, noise_floor=floor)
        variants = side_by_side(records, baseline_records)
        baseline_dict = rendered.diff.to_dict() | {"path": str(baseline)}
        summary["regressions"] = len(rendered.diff.regressed)
        summary["ratchet"] = {
            "loosened": len(rendered.diff.loosened),
            "weakened": len(rendered.diff.weakened),
            "factor": rendered.diff.ratchet_factor,
        }
        regressions = run_dir / "regressions.json"
        write_text_atomic(regressions, finite_json.dumps(baseline_dict, indent=2) + "\n")
        rendered.written.append(regressions)
    rendered.written += write_tables(run_dir, records, summary)
    entries = read_history(history) if history is not None else []
    if append and history is not None:
        entry = history_entry(records, summary)
        append_history(history, entry)
        entries.append(entry)
    rendered.written.append(
        write_html(
            run_dir / "drift.html",
            records,
            summary,
            baseline=baseline_dict,
            history=entries,
            variants=variants,
            compiled=compiled_cost(records),
        )
    )
    return rendered


def _previous_header(run_dir: Path, session: dict[str, Any] | None) -> dict[str, Any]:
    """The header of a run rebuilt offline: its summary.json's, else its session file's (the
    tables were never written: a disk that filled), with the run's id."""
    previous = run_dir / "summary.json"
    if previous.is_file():
        header: dict[str, Any] = json.loads(previous.read_text(encoding="utf-8"))
    else:
        keep = ("run_id", "device", "dtypes", "tier", "versions", "host", "python", "tests")
        header = {k: session[k] for k in keep if k in session} if session else {}
    header.setdefault("run_id", run_dir.name)
    return header


def merge_runs(sources: list[Path], out_dir: Path) -> Path:
    """Joins the records of several runs (shards, machines) into ``out_dir``/records.jsonl;
    a record key seen twice keeps the later source's record. Where every source has its
    session file, the merged run has one too (``merge_sessions``), so that its report says
    what the records lack against the sessions that wrote them."""
    runs = [read_records(s) for s in sources]
    merged = merge_records(runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_records(out_dir / "records.jsonl", merged)
    headers = [
        json.loads((s / "summary.json").read_text())
        for s in sources
        if (s / "summary.json").is_file()
    ]
    header = dict(headers[0]) if headers else {}
    for key in RunVerdict.KEYS:  # the first source's verdict is not the merged run's
        header.pop(key, None)
    header["run_id"] = out_dir.name
    header["merged_from"] = [str(s) for s in sources]
    # shards (disjoint tests) add up their controllers' counts, tests without records
    # included; runs that share tests count the merged records' tests
    ids = [{r.test_id for r in run} for run in runs]
    disjoint = sum(map(len, ids)) == len(set().union(*ids))
    if disjoint and len(headers) == len(sources) and all(h.get("tests") for h in headers):
        total: Counter[str] = Counter()
        for h in headers:
            total.update(h["tests"])
        header["tests"] = count_outcomes(o for o, n in total.items() for _ in range(n))
    else:
        header["tests"] = count_outcomes(outcome_of(merged).values())
    sessions = [read_session(s) for s in sources]
    if all(sessions):
        write_session(out_dir, merge_sessions([s for s in sessions if s], disjoint))
    else:
        (out_dir / SESSION_FILE).unlink(missing_ok=True)  # a previous merge's is not this one's
    write_text_atomic(out_dir / "summary.json", json.dumps(header, indent=2) + "\n")
    return out_dir
