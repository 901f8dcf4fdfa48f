"""Separation, measured: per zoo set and dtype, the worst use of budget over the honest
matrix (``ci/honest_matrix.py``: kernel variants that are not calibration members) against
the smallest use of budget among the planted bugs that must fail, and their ratio (the
margin; above 1 means every planted bug stands out of every honest variant's noise).

    python bench/bench_separation.py [--matrix REPORTS] [-k EXPR]

``--matrix``: a report folder the matrix wrote (``python ci/honest_matrix.py --report-dir
DIR``); without it the matrix's model suites run first. The planted bugs
(``tests/replay/planted_models.py``) are swapped into the model suites one at a time: an
RMSNorm with epsilon 1e-2, one 1% too large, and GPT-J's interleaved rotary where the model
rotates halves. A bug's use of budget in a set and dtype is its worst record there (how far
its strongest symptom lies past the budget). A bug applies to a set where it fails in
float32 (where its swap changed the model at all); the margin is the weakest applicable bug's
use over the honest worst (below 1: a bug the suites miss in that dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANTED = ("rms_norm=bad_eps", "rms_norm=scaled_1pct", "rope_tables=bad_interleaved")


def worst_by_model_dtype(folder: Path, *, passed_only: bool) -> dict[tuple[str, str], float]:
    """The largest use of budget per (model, dtype) over every records.jsonl under folder:
    of passed records only for the honest runs (an expected failure, the paged engine's
    soft-capping gap, is not honest noise), of every judged record for a planted bug."""
    worst: dict[tuple[str, str], float] = defaultdict(float)
    for path in folder.rglob("records.jsonl"):
        if path.parent.is_symlink():  # reports/latest points at a run already read
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            used, model, verdict = (
                record.get("budget_used"),
                record.get("model"),
                record.get("verdict"),
            )
            if not model or not isinstance(used, int | float) or verdict == "skipped":
                continue
            if passed_only and verdict != "passed":
                continue
            key = (model, record.get("dtype") or "")
            worst[key] = max(worst[key], float(used))
    return dict(worst)


def run_planted(swap: str, out: Path, select: str | None) -> None:
    command = [sys.executable, "-m", "pytest", "suites/models", "-q", "-n", "2",
               "-p", "no:cacheprovider", "--report-dir", str(out), "--candidates",
               "planted_models", "--swap", swap]  # fmt: skip
    if select:
        command += ["-k", select]
    env = os.environ | {"PYTHONPATH": f"{ROOT / 'tests' / 'replay'}:{ROOT}", "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, cwd=ROOT, env=env, capture_output=True, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--matrix", type=Path, help="a report folder of ci/honest_matrix.py")
    parser.add_argument("-k", dest="select", help="pytest -k expression for the planted runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="numalign-separation-") as scratch:
        matrix = args.matrix
        if matrix is None:
            matrix = Path(scratch) / "matrix"
            subprocess.run([sys.executable, str(ROOT / "ci" / "honest_matrix.py"),
                            "--report-dir", str(matrix)], cwd=ROOT, check=False)  # fmt: skip
        honest = worst_by_model_dtype(matrix, passed_only=True)
        planted: dict[str, dict[tuple[str, str], float]] = {}
        for swap in PLANTED:
            out = Path(scratch) / swap.replace("=", "-")
            run_planted(swap, out, args.select)
            planted[swap] = worst_by_model_dtype(out, passed_only=False)
    # a bug applies to a set where float32 sees it (the swap changed the model): there it
    # should fail in every dtype, and the weakest such use is the set's margin
    print(f"{'set':18} {'dtype':9} {'honest':>7} " + " ".join(f"{b:>28}" for b in PLANTED)
          + f" {'margin':>8}")  # fmt: skip
    for key in sorted(honest):
        model, dtype = key
        uses = []
        for swap in PLANTED:
            applies = planted[swap].get((model, "float32"), 0.0) > 1.0
            used = planted[swap].get(key)
            uses.append(used if applies else None)
        cells = " ".join(f"{u:28.3g}" if u is not None else f"{'n/a':>28}" for u in uses)
        real = [u for u in uses if u is not None]
        margin = f"{min(real) / honest[key]:8.2f}" if real and honest[key] > 0 else f"{'-':>8}"
        print(f"{model:18} {dtype:9} {honest[key]:7.3g} {cells} {margin}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
