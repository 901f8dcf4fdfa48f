"""Renders a run of 100,000 drift records (operator and model records, 2% failing) and
prints the time to write every table and drift.html, and the HTML size.
Targets: 20 s or less, 15 MB or less.

    python bench/bench_report.py [--records N]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from numalign.report import render_run

OPERATORS = ["rms_norm", "softmax", "attention", "linear", "rope_neox", "moe_routing", "cumsum"]
DTYPES = ["float32", "bfloat16", "float16"]


def synthetic(n: int) -> list[dict]:
    rng = random.Random(0)
    records = []
    for i in range(n):
        model = i % 5 == 0
        dtype = DTYPES[i % 3]
        used = rng.lognormvariate(-2, 1.2)
        failed = used > 1.0
        point = f"model.layers.{i % 40}.mlp" if model else f"{OPERATORS[i % len(OPERATORS)]}"
        records.append({
            "schema": 1, "test_id": f"suites/x.py::test_{i}[c-{dtype}-case{i % 97}]",
            "suite": "models" if model else "operators", "point": point, "candidate": "c",
            "device": "cpu", "dtype": dtype, "case": f"case{i % 97}", "shape": [8, 4096],
            "verdict": "failed" if failed else "passed", "rule": "budget", "reason": "r",
            "budget_used": used, "duration_s": 0.01, "golden_fingerprint": None, "swap": None,
            "model": f"set{i % 3}" if model else None,
            "mode": ("isolated", "accumulated")[i % 2] if model else None,
            "point_index": i % 40,
            "metrics": {"max_abs": used * 1e-3, "rel_l2": used * 1e-4, "ulp_p99": used,
                        "max_rel": used * 1e-3, "cosine": 1.0, "norm_ratio": 1.0},
            "budget": {"max_abs": 1e-3, "rel_l2": 1e-4},
            "message": ("rms_norm [bfloat16, 8x4096] is not aligned: ...\\n" * 8)
            if failed else None,
        })  # fmt: skip
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        with (run / "records.jsonl").open("w") as fh:
            for record in synthetic(args.records):
                fh.write(json.dumps(record) + "\n")
        start = time.perf_counter()
        render_run(run, header={"run_id": "bench", "tier": "pr"})
        elapsed = time.perf_counter() - start
        size = (run / "drift.html").stat().st_size
    print(f"records:           {args.records}")
    print(f"render time:       {elapsed:6.2f} s   (target <= 20 s)")
    print(f"drift.html size:   {size / 1e6:6.2f} MB  (target <= 15 MB)")


if __name__ == "__main__":
    main()
