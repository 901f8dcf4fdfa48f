"""Runs the real operator suite in a subprocess on kernels written outside the project, as a
user runs it with ``--candidates``: the tests of the suite's bug-finding power share it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from numalign.record import DriftRecord, read_records

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "suites" / "operators"


def run_operator_suite(
    outside: Path, modules: list[str], *, tier: str = "pr", select: str = "wrong_ or right_"
) -> tuple[str, list[DriftRecord]]:
    """The suite at ``tier`` (all dtypes, ``-n 2``) over the candidates that ``modules``
    (importable from ``outside``) register, restricted to ``-k select``: its output and its
    drift records."""
    reports = outside / f"reports-{tier}-{'-'.join(modules)}"
    path = os.pathsep.join(p for p in (str(outside), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    args = [sys.executable, "-m", "pytest", str(SUITE), "--tier", tier, "--report-dir",
            str(reports), "-k", select, "-n", "2", "-q", "-p", "no:cacheprovider",
            "--tb=line", "-rf"]  # fmt: skip
    for module in modules:
        args += ["--candidates", module]
    proc = subprocess.run(
        args, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    return proc.stdout + proc.stderr, read_records(reports / "latest")


def assert_passes_in_every_dtype(output: str, records: list[DriftRecord], name: str) -> None:
    """A correct-but-different kernel: no test of it failed, and its records cover the three
    default dtypes, every one passed."""
    __tracebackhide__ = True
    assert not re.findall(rf"FAILED \S+\[{name}-", output), output[-3000:]
    mine = [r for r in records if r.candidate == name]
    assert {r.dtype for r in mine} == {"float32", "bfloat16", "float16"}
    assert all(r.verdict == "passed" for r in mine)
