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
its strongest symptom lies past the budget); the table takes the weakest bug.
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


def worst_by_model_dtype(folder: Path) -> dict[tuple[str, str], float]:
    """The largest use of budget per (model, dtype) over every records.jsonl under folder."""
    worst: dict[tuple[str, str], float] = defaultdict(float)
    for path in folder.rglob("records.jsonl"):
        if path.parent.is_symlink():  # reports/latest points at a run already read
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            used, model = record.get("budget_used"), record.get("model")
            if model and isinstance(used, int | float) and record.get("verdict") != "skipped":
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
        honest = worst_by_model_dtype(matrix)
        planted: dict[tuple[str, str], float] = {}
        weakest: dict[tuple[str, str], str] = {}
        for swap in PLANTED:
            out = Path(scratch) / swap.replace("=", "-")
            run_planted(swap, out, args.select)
            for key, used in worst_by_model_dtype(out).items():
                if key not in planted or used < planted[key]:
                    planted[key], weakest[key] = used, swap
    print(f"{'set':18} {'dtype':9} {'honest worst':>12} {'planted weakest':>16} {'margin':>8}  bug")
    for key in sorted(set(honest) | set(planted)):
        h, p = honest.get(key), planted.get(key)
        margin = f"{p / h:8.1f}" if h and p else f"{'-':>8}"
        h_text = f"{h:12.3g}" if h is not None else f"{'-':>12}"
        p_text = f"{p:16.3g}" if p is not None else f"{'-':>16}"
        print(f"{key[0]:18} {key[1]:9} {h_text} {p_text} {margin}  {weakest.get(key, '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
