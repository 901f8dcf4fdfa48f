"""One model type's sweep, in the process that runs it (``numalign.sweep.run`` starts one
per type, with a timeout): build the tiny checkpoint, capture it (calibrated), replay it
honestly in float32 and bfloat16 (layer, model, decode with every cache) and count false
alarms and crashes, then plant norms 2% too large (``sweep.planted``) and say where the
whole-model replay first caught them.

    python -m numalign.sweep.one TYPE WORK_DIR SUITES_DIR   # prints the row as JSON
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from numalign.sweep.table import SweepRow

#: The honest replay's dtypes, and every decode cache it replays.
HONEST_DTYPES = "float32,bfloat16"
CACHES = "dynamic,static,offloaded,offloaded_static,paged"
#: A planted norm is looked for in float32, where honest rounding is smallest.
PLANTED_DTYPE = "float32"
#: xdist workers of the planted replay: its swap runs as users run one (``pytest -n auto``),
#: the controller apart from the workers that load and swap the model, so that what fails
#: only in a worker (a swap's usage error) fails here too; 2, the fewest that make it such a
#: session, on machines the sweep shares.
PLANTED_WORKERS = 2
#: The operators a planted norm is swapped for, in order of preference.
NORM_OPERATORS = ("rms_norm", "layer_norm")
#: Characters of a message kept in a table cell.
MESSAGE_CHARS = 160


def _short(exc: BaseException | str) -> str:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:MESSAGE_CHARS]


def _pytest(suites: Path, golden: Path, reports: Path, *args: str) -> tuple[int, str]:
    cmd = [
        sys.executable, "-m", "pytest", str(suites / "models"), "--golden", str(golden),
        "--golden-only", "--tier", "smoke", "-p", "no:cacheprovider", "-q", "-rs",
        "--report-dir", str(reports), *args,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=suites.parent)
    return done.returncode, done.stdout + done.stderr


def _outcomes(reports: Path) -> dict[str, str]:
    """test id -> its outcome as pytest counted it (``record.outcome_of``: an expected
    failure, such as a known divergence of the paged engine, is ``xfailed``, never failed)."""
    from numalign.records.drift import outcome_of, read_records

    latest = reports / "latest"
    if not (latest / "records.jsonl").is_file():
        return {}
    return outcome_of(read_records(latest))


def honest(row: SweepRow, suites: Path, golden: Path, reports: Path) -> None:
    """The honest replay's verdicts into ``row``: false alarms (failed tests), crashes
    (errors, crashed tests, or a pytest that ended without a run)."""
    code, output = _pytest(
        suites, golden, reports, "--dtype", HONEST_DTYPES, "--cache-implementation", CACHES
    )
    outcomes = Counter(_outcomes(reports).values())
    found = re.findall(r"(\d+) skipped", output)
    skipped = int(found[-1]) if found else 0
    row.false_alarms = outcomes["failed"]
    row.crashes = outcomes["error"] + outcomes["crashed"]
    if code not in (0, 1) or not outcomes:
        row.crashes = max(row.crashes, 1)
        row.replay = "crash: " + _short(output.strip().splitlines()[-1] if output.strip() else "")
        return
    state = "clean" if not row.false_alarms and not row.crashes else "not clean"
    expected = f", {outcomes['xfailed']} expected failures" if outcomes["xfailed"] else ""
    row.replay = f"{state} ({outcomes['passed']} passed, {skipped} skipped{expected})"


def planted(row: SweepRow, suites: Path, golden: Path, reports: Path, model_dir: Path) -> None:
    """Where the planted norms were first caught: the first divergence of the whole-model
    replay (under xdist, ``PLANTED_WORKERS``), named a norm or not by the captured point's
    module type."""
    from numalign.golden import GoldenSet
    from numalign.ops.registry import load_catalogue

    load_catalogue()
    # by what the modules compute, not their names (CpmAnt's "LayerNorm" is an RMSNorm), and
    # only where the adapter reads a norm's arguments (a norm without a scale keeps its own)
    from numalign.replay.swap import meta_model

    built = meta_model(model_dir, device="cpu")  # an adapter probes the module: not on meta
    operator = next((op for op in NORM_OPERATORS if _norms(built, op, readable=True)), None)
    if operator is None:
        row.planted = why_not_planted(built)
        return
    swap = f"{operator}=sweep_scaled_2pct"
    code, output = _pytest(
        suites, golden, reports, "--dtype", PLANTED_DTYPE, "-k", "test_model",
        "--candidates", "numalign.sweep.planted", "--swap", swap, "-n", str(PLANTED_WORKERS),
    )  # fmt: skip
    if code not in (0, 1):
        row.planted = "no: " + _short(output.strip().splitlines()[-1] if output.strip() else "")
        return
    from numalign.records.drift import read_records

    points = {p.name: p.type for p in GoldenSet.open(golden).points}
    records = read_records(reports / "latest")
    found = [r.first_divergence["point"] for r in records
             if r.first_divergence and r.mode != "decode"]  # fmt: skip
    broken = [r for r in records if r.verdict in ("error", "crashed")]
    if not found and broken:
        row.planted = "no: " + _short(broken[0].message or broken[0].error or "an error")
        return
    if not found:
        row.planted = "not caught"
        return
    point = found[0]
    if "Norm" in (points.get(point) or ""):
        kind = "norm"
    else:
        inside = [n for n in norm_names(model_dir, swap.partition("=")[0])
                  if n.startswith(point + ".")]  # fmt: skip
        # a norm inside the point that capture does not hold (OLMo-2's q_norm in attention)
        kind = f"norm inside: {inside[0]}" if inside else "not a norm"
    row.planted = f"{point} ({kind})"


def norm_names(model_dir: Path, operator: str, *, readable: bool = False) -> list[str]:
    """The names of the modules of the model at ``model_dir`` that ``operator`` stands for
    (built as its config's class, no weights read: on the meta device, or with ``readable``
    on the CPU, since an adapter probes the module; the sweep's models are tiny), with
    ``readable`` only those whose arguments the operator's adapter reads (the ones a swap
    replaces)."""
    from numalign.replay.swap import meta_model

    model = meta_model(model_dir, device="cpu" if readable else "meta")
    return _norms(model, operator, readable=readable)


def _norms(model: Any, operator: str, *, readable: bool = False) -> list[str]:
    """``norm_names`` of a model already built."""
    from numalign.ops.registry import OPERATORS
    from numalign.replay.swap import adapts

    op = OPERATORS[operator]
    return [n for n, m in model.named_modules()
            if n and op.stands_for_module(m) and (not readable or adapts(op, m))]  # fmt: skip


def why_not_planted(model: Any) -> str:
    """The planted cell of a model (built) with no norm a norm adapter reads: the norm types
    it has that an operator stands for but whose scale it lacks, or the ones no operator
    stands for."""
    modules = dict(model.named_modules())
    for op in NORM_OPERATORS:
        unread = sorted({type(modules[n]).__name__ for n in _norms(model, op)})
        if unread:
            return (f"not planted: its norms ({', '.join(unread)}) have no scale, which the "
                    f"adapter of {op} reads; a scale-free form is not taught yet")  # fmt: skip
    norms = sorted({type(m).__name__ for m in modules.values() if "Norm" in type(m).__name__})
    if norms:
        return (f"not planted: its norms ({', '.join(norms)}) are no module rms_norm or "
                "layer_norm stands for")  # fmt: skip
    return "not planted: no norm module"


def sweep_type(model_type: str, work: Path, suites: Path) -> SweepRow:
    """The sweep of one type: every step that can run, each failure kept in its column."""
    from numalign.golden.capture_spec import CaptureSpec
    from numalign.replay.ensemble import capture_calibrated
    from numalign.sweep.build import BuildError, build_tiny

    start = time.monotonic()
    row = SweepRow(model_type)
    try:
        model_dir = build_tiny(model_type, work / "models")
        row.built = "yes"
    except BuildError as exc:
        row.built = "no: " + _short(str(exc))
    if row.buildable:
        golden = work / "sets" / model_type
        try:
            capture_calibrated(model_dir, golden, CaptureSpec(progress=False))
            row.capture = "ok"
        except Exception as exc:
            row.capture, row.crashes = "crash: " + _short(exc), 1
        if row.capture == "ok":
            reports = work / "reports" / model_type
            honest(row, suites, golden, reports / "honest")
            try:
                planted(row, suites, golden, reports / "planted", model_dir)
            except Exception as exc:  # the row keeps what ran before it
                row.planted, row.crashes = "crash: " + _short(exc), row.crashes + 1
    row.seconds = round(time.monotonic() - start, 1)
    return row


def main(argv: list[str]) -> int:
    model_type, work, suites = argv[0], Path(argv[1]), Path(argv[2])
    row = sweep_type(model_type, work, suites)
    print("SWEEP-ROW " + json.dumps(dataclasses.asdict(row)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
