"""Reports retention: a report folder keeps its newest runs, not every run ever made.

Each session writes a run folder (records, tables, drift.html: tens of MB for a full run),
so a folder of runs grows without bound. At the end of a session the collector keeps the
``keep`` newest runs (``--keep-runs``); older ones are removed. Never removed: the run
``latest`` points to, the run given as the baseline, and any folder numalign did not write
as a run (a run folder is one holding records.jsonl and a summary.json whose ``run_id`` is
the folder's name and that merged nothing: ``numalign report merge`` outputs are the user's).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

#: Runs a report folder keeps by default: a week of nightlies and a few more; about 60 MB
#: each for a full run of the zoo, so about 0.6 GB.
DEFAULT_KEEP_RUNS = 10


def run_folders(report_dir: Path) -> list[Path]:
    """The run folders numalign wrote directly under ``report_dir``, oldest first (by the
    time their records were last written)."""
    runs = []
    for folder in report_dir.iterdir() if report_dir.is_dir() else []:
        if folder.is_symlink() or not folder.is_dir():
            continue
        records, summary = folder / "records.jsonl", folder / "summary.json"
        if not (records.is_file() and summary.is_file()):
            continue
        try:
            header = json.loads(summary.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if header.get("run_id") == folder.name and not header.get("merged_from"):
            runs.append(folder)
    return sorted(runs, key=lambda f: ((f / "records.jsonl").stat().st_mtime, f.name))


def prune_runs(report_dir: Path, keep: int, protect: Iterable[Path | None] = ()) -> list[Path]:
    """Removes all but the ``keep`` newest run folders of ``report_dir`` (``keep`` 0: keep
    all), never one of ``protect`` nor the one ``latest`` points to; returns the removed."""
    if keep <= 0:
        return []
    kept = {p.resolve() for p in protect if p is not None}
    latest = report_dir / "latest"
    if latest.exists():
        kept.add(latest.resolve())
    pointer = report_dir / "LATEST"
    if pointer.is_file():
        kept.add((report_dir / pointer.read_text(encoding="utf-8").strip()).resolve())
    runs = run_folders(report_dir)
    removed = []
    for folder in runs[: max(0, len(runs) - keep)]:
        if folder.resolve() in kept:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed
