"""Runs the real operator suite in a subprocess on kernels written outside the project, as a
user runs it with ``--candidates``: the tests of the suite's bug-finding power share it, each
on the kernels of the catalogue of planted kernels (``planted_kernels.py``) it is about."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from numalign.records.drift import DriftRecord, read_records

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "suites" / "operators"
PLANTED = Path(__file__).with_name("planted_kernels.py")
#: The module name the catalogue of planted kernels has outside the repository.
VENDOR_MODULE = "vendor_kernels"


def select(kernels: Iterable[tuple[str, str]]) -> str:
    """The ``-k`` expression of exactly these (kernel, operator) pairs: one kernel name may
    stand for several operators' kernels (``wrong_truncates``), and an operator's tests hold
    other kernels of the catalogue."""
    return " or ".join(f"(test_{operator} and {name})" for name, operator in sorted(set(kernels)))


def run_operator_suite(
    outside: Path, kernels: Iterable[tuple[str, str]], *, tier: str = "pr"
) -> tuple[str, list[DriftRecord]]:
    """The suite at ``tier`` (all dtypes, ``-n 2``) over these (kernel, operator) pairs of the
    catalogue of planted kernels, copied into ``outside`` as a vendor's module and named with
    ``--candidates``: its output and its drift records."""
    shutil.copy(PLANTED, outside / f"{VENDOR_MODULE}.py")
    reports = outside / f"reports-{tier}"
    path = os.pathsep.join(p for p in (str(outside), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    args = [sys.executable, "-m", "pytest", str(SUITE), "--tier", tier, "--report-dir",
            str(reports), "-k", select(kernels), "-n", "2", "-q", "-p", "no:cacheprovider",
            "--tb=line", "-rf", "--candidates", VENDOR_MODULE]  # fmt: skip
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
