"""Cost of the operator suite, by phase: serial against two xdist workers, cold truth cache
against warm.

Runs ``pytest suites/operators --tier T`` (smoke and pr) in subprocesses, each side by side
in one invocation so that the ratios compare like with like on a shared machine:

- pytest's own costs, measured from the outside: start-up and collection (``--collect-only``)
  and xdist's worker start-up (a one-test file with ``-n 2`` against ``-n 0``);
- the suite with ``-n 0`` and ``-n 2`` and the truth cache off (every truth computed), with
  the time inside the tests split into phases (inputs, truth, cache, control, candidate,
  compare, records; summed over the workers) by ``numalign.ops.phases``, which this file reads
  at the end of each process as a ``-p`` plugin;
- at pr, with ``-n 2``, a cold run (an empty truth cache, which it fills) and a warm one
  (the same cache again).

Prints a table and the ratios. Targets: smoke with ``-n 2`` no slower than ``-n 0``; pr
with ``-n 2`` at least 1.5x faster; the warm pr run at least 2x faster than the cold one.

    python bench/bench_suite.py [--tiers smoke,pr] [--workers 2] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PHASES_ENV = "NUMALIGN_BENCH_PHASES"


# --- the -p plugin: loaded into each pytest process (controller and workers) -------------


def pytest_collection_finish(session: Any) -> None:
    from numalign.ops.truths import active_truth_cache

    _threads["collection"] = _torch_threads()
    _cache.append(active_truth_cache())


_controller: dict[str, float] = {"reports received": 0.0, "session end": 0.0}


def _timed(name: str) -> Any:
    import pytest

    @pytest.hookimpl(wrapper=True)
    def hook(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return (yield)
        finally:
            _controller[name] += time.perf_counter() - start

    return hook


#: On the controller (or a serial run): every plugin's handling of the test reports (drift
#: records, terminal, xdist), and the session's end (the run reports are rendered there).
pytest_runtest_logreport = _timed("reports received")
pytest_sessionfinish = _timed("session end")


def pytest_unconfigure(config: Any) -> None:
    """Writes this process's phase totals (and torch's thread counts) for the bench."""
    if hasattr(config, "workerinput"):
        _controller.clear()
    folder = os.environ.get(PHASES_ENV)
    if not folder:
        return
    from numalign.ops.phases import phase_totals

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    cache = _cache[-1] if _cache else None
    out = {
        "phases": {**phase_totals(), **_controller},
        "threads": {**_threads, "end": _torch_threads()},
        "cache": cache.stats if cache is not None else {},
    }
    Path(folder, f"{worker}.json").write_text(json.dumps(out))


_threads: dict[str, int | None] = {}
_cache: list[Any] = []


def _torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else None


# --- the bench -------------------------------------------------------------------------


def run(args: Sequence[str], *, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Wall seconds of ``python -m pytest ARGS`` from the repository root, and its last line."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "bench"), full_env.get("PYTHONPATH", "")) if p
    )
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT, env=full_env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode not in (0, 1):  # 1: some test failed, still a measurement
        raise SystemExit(f"pytest {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}")
    return wall, lines[-1] if lines else ""


def suite_run(
    tier: str, workers: int, scratch: Path, label: str, cache: str = "off"
) -> dict[str, Any]:
    """One suite run: wall time, phase totals summed over processes, thread counts."""
    phases_dir = scratch / f"phases-{label}"
    phases_dir.mkdir()
    args = ["suites/operators", "--tier", tier, "-n", str(workers), "-q", "-p", "bench_suite",
            "--report-dir", str(scratch / f"reports-{label}"), "--truth-cache", cache]  # fmt: skip
    wall, last = run(args, env={PHASES_ENV: str(phases_dir)})
    totals: dict[str, float] = {}
    threads: dict[str, list[int | None]] = {}
    stats: dict[str, int] = {}
    for path in sorted(phases_dir.glob("*.json")):
        data = json.loads(path.read_text())
        for name, seconds in data["phases"].items():
            totals[name] = totals.get(name, 0.0) + seconds
        for when, count in data["threads"].items():
            threads.setdefault(when, []).append(count)
        for name, count in data["cache"].items():
            stats[name] = stats.get(name, 0) + count
    print(f"  {label:<18} {wall:7.1f} s   {last}", flush=True)
    return {"wall": wall, "phases": totals, "threads": threads, "cache": stats}


def outside_costs(tiers: Sequence[str], workers: int, scratch: Path) -> dict[str, float]:
    """Start-up and collection per tier, and xdist's worker start-up, in seconds."""
    trivial = scratch / "trivial"
    trivial.mkdir()
    (trivial / "test_trivial.py").write_text("def test_nothing():\n    pass\n")
    costs: dict[str, float] = {}
    for tier in tiers:
        costs[f"collect {tier}"], _ = run(["suites/operators", "--tier", tier, "--collect-only",
                                           "-q"])  # fmt: skip
    reports = ["--report-dir", str(scratch / "reports-trivial")]
    serial, _ = run([str(trivial), "-n", "0", "-q", *reports])
    parallel, _ = run([str(trivial), "-n", str(workers), "-q", *reports])
    costs["one test -n 0"] = serial
    costs[f"one test -n {workers}"] = parallel
    print(f"  {'outside':<18} " + ", ".join(f"{k} {v:.1f} s" for k, v in costs.items()))
    return costs


def table(columns: dict[str, dict[str, Any]]) -> str:
    from numalign.ops.phases import PHASES

    names = list(columns)
    lines = [f"| phase (s) | {' | '.join(names)} |", "| --- |" + " ---: |" * len(names)]
    for name in (*PHASES, "reports received", "session end"):
        cells = [f"{columns[c]['phases'].get(name, 0.0):.1f}" for c in names]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    inside = [sum(columns[c]["phases"].get(p, 0.0) for p in PHASES) for c in names]
    lines.append(f"| in tests (sum over workers) | {' | '.join(f'{v:.1f}' for v in inside)} |")
    walls = [f"{columns[c]['wall']:.1f}" for c in names]
    lines.append(f"| wall | {' | '.join(walls)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", default="smoke,pr", help="comma list (default smoke,pr)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-cache-runs", action="store_true", help="skip warm against cold")
    parser.add_argument("--cache-only", action="store_true", help="only warm against cold")
    args = parser.parse_args()
    tiers = [t for t in args.tiers.split(",") if t]
    n = args.workers
    with tempfile.TemporaryDirectory(prefix="bench-suite-") as tmp:
        scratch = Path(tmp)
        print(f"cores {len(os.sched_getaffinity(0))}, workers {n}; runs:", flush=True)
        outside = {} if args.cache_only else outside_costs(tiers, n, scratch)
        columns: dict[str, dict[str, Any]] = {}
        for tier in [] if args.cache_only else tiers:
            columns[f"{tier} -n 0"] = suite_run(tier, 0, scratch, f"{tier}-n0")
            columns[f"{tier} -n {n}"] = suite_run(tier, n, scratch, f"{tier}-n{n}")
        warm_tier = "pr" if "pr" in tiers else tiers[-1]
        if not args.no_cache_runs:
            folder = str(scratch / "truths")
            columns[f"{warm_tier} cold"] = suite_run(warm_tier, n, scratch, "cold", folder)
            columns[f"{warm_tier} warm"] = suite_run(warm_tier, n, scratch, "warm", folder)
    print()
    print(table(columns))
    print()
    for key, seconds in outside.items():
        print(f"{key:<24} {seconds:6.1f} s")
    if outside:
        print(f"xdist start-up (-n {n} minus -n 0, one test): "
              f"{outside[f'one test -n {n}'] - outside['one test -n 0']:.1f} s")  # fmt: skip
    for name, column in columns.items():
        print(f"torch threads {name:<12}: {column['threads']}   truth cache: {column['cache']}")
    print()
    targets = {"smoke": 1.0, "pr": 1.5}
    for tier in [] if args.cache_only else tiers:
        ratio = columns[f"{tier} -n 0"]["wall"] / columns[f"{tier} -n {n}"]["wall"]
        target = targets.get(tier, 1.0)
        verdict = "met" if ratio >= target else "NOT met"
        print(f"{tier}: -n {n} is {ratio:.2f}x faster than -n 0 (target >= {target}x: {verdict})")
    if not args.no_cache_runs:
        ratio = columns[f"{warm_tier} cold"]["wall"] / columns[f"{warm_tier} warm"]["wall"]
        verdict = "met" if ratio >= 2.0 else "NOT met"
        print(f"{warm_tier}: warm truth cache is {ratio:.2f}x faster than cold "
              f"(-n {n}; target >= 2x: {verdict})")  # fmt: skip


if __name__ == "__main__":
    main()
