"""``numalign zoo sweep``: every selected causal-LM type swept in a process of its own
(``sweep.one``) under a timeout, so that one hang or crash does not stop the sweep; each row
appended to the CSV as it finishes and the markdown table rewritten, so an interrupted sweep
keeps its finished rows; ``resume`` skips the types the CSV already holds."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from numalign.sweep.table import SweepRow, append_row, markdown, read_rows

#: Seconds one type may take (build, capture, both replays) before it is stopped and listed
#: as a crash: about twice the slowest swept type on 2 shared CPU cores (docs/sweep.md).
TYPE_TIMEOUT_S = 600.0


def select_types(
    available: Sequence[str],
    wanted: Sequence[str] | None,
    limit: int | None,
    shard: str | None = None,
) -> list[str]:
    """The types to sweep: ``wanted`` (each must be available: ValueError naming the unknown
    ones) or all of ``available``, in order, at most ``limit``; with ``shard`` ``I/N``, every
    N-th of them from the I-th (a nightly's machines share the sweep)."""
    if shard:
        index, _, count = shard.partition("/")
        if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
            raise ValueError(f"--shard {shard}: write I/N with 1 <= I <= N, e.g. 1/4")
        chosen = select_types(available, wanted, limit)
        return chosen[int(index) - 1 :: int(count)]
    if wanted:
        unknown = [t for t in wanted if t not in available]
        if unknown:
            raise ValueError(
                f"unknown model types {unknown}: not in the installed transformers' causal-LM "
                f"mapping (it has {len(available)}, e.g. {', '.join(available[:5])})"
            )
        chosen = list(wanted)
    else:
        chosen = list(available)
    return chosen[:limit] if limit else chosen


def _one(model_type: str, work: Path, suites: Path, timeout: float) -> SweepRow:
    start = time.monotonic()
    cmd = [sys.executable, "-m", "numalign.sweep.one", model_type, str(work), str(suites)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return SweepRow(model_type, replay=f"crash: timed out after {timeout:.0f} s", crashes=1,
                        seconds=round(time.monotonic() - start, 1))  # fmt: skip
    line = next((x for x in done.stdout.splitlines() if x.startswith("SWEEP-ROW ")), None)
    if line is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return SweepRow(model_type, replay=f"crash: exit {done.returncode}: {tail[0][:160]}",
                        crashes=1, seconds=round(time.monotonic() - start, 1))  # fmt: skip
    return SweepRow(**json.loads(line.removeprefix("SWEEP-ROW ")))


def heading(command: str) -> str:
    """The table's heading: date, versions, machine and command."""
    import torch
    import transformers

    return (
        f"Sweep of {time.strftime('%Y-%m-%d')}: transformers {transformers.__version__}, torch "
        f"{torch.__version__}, {platform.machine()} with {os.cpu_count()} CPU cores; "
        f"`{command}`"
    )


def sweep(
    types: Sequence[str],
    out: Path,
    suites: Path,
    *,
    timeout: float = TYPE_TIMEOUT_S,
    resume: bool = False,
    command: str = "numalign zoo sweep",
) -> list[SweepRow]:
    """Sweeps ``types`` into ``out`` (``sweep.csv``, ``sweep.md``, and the work folders);
    prints each row as it finishes (``table.changes`` compares the rows with a previous
    sweep's)."""
    out.mkdir(parents=True, exist_ok=True)
    table = out / "sweep.csv"
    if not resume and table.exists():
        table.unlink()
    done = {r.type for r in read_rows(table)}
    title = heading(command)
    for model_type in types:
        if model_type in done:
            continue
        row = _one(model_type, out / "work", suites, timeout)
        append_row(table, row)
        (out / "sweep.md").write_text(markdown(read_rows(table), title), encoding="utf-8")
        print(f"numalign sweep: {json.dumps(dataclasses.asdict(row))}", flush=True)
    return read_rows(table)
