"""A swap never aborts a session run as users run it (``pytest -n 2``): whatever it raises is
the outcome of the tests it touches, with the reason. A swap that matches no module of the
selected models is a usage error before any test runs in a plain session; under xdist it was
raised in each worker after the worker had sent its tests to the controller, the worker's
session ended with its tests unreported and xdist stopped on an INTERNALERROR
(``AssertionError: ('...test_decode[...-cohere2-bfloat16-dynamic]', <WorkerController gw0>)``,
Cohere 2 under ``--swap rms_norm=...``: its norms are LayerNorms). A candidate that raises
inside a test is that test's failure, with an ``error`` record."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from numalign.records.drift import read_records
from numalign.replay.swap import SwapError, parse_swaps

ROOT = Path(__file__).resolve().parents[2]
MODEL_SUITE = ROOT / "suites" / "models" / "test_model.py"

#: A candidate that raises whenever the swapped model runs it.
RAISING = """
import numalign


@numalign.candidate("rms_norm", name="raises")
def raises(x, weight, eps, offset=0.0):
    raise RuntimeError("planted: this kernel raises")
"""


def _xdist(reports: Path, extra_path: Path, *args: str) -> tuple[int, str]:
    """The model suite's test_model in float32 and bfloat16 (two tests a model, one for each
    of the two workers) under ``-n 2``; its exit code and output."""
    path = os.pathsep.join([str(extra_path), str(ROOT / "src"), str(ROOT)])
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(MODEL_SUITE), "--rootdir", str(ROOT), "-n", "2",
         "-p", "no:cacheprovider", "-q", "-rfEs", "--dtype", "float32,bfloat16",
         "--report-dir", str(reports), *args],
        capture_output=True, text=True, cwd=ROOT / "tests", check=False, timeout=600,
        env={**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def _ids(model: str) -> set[str]:
    return {
        f"suites/models/test_model.py::test_model[{model}-{dtype}]"
        for dtype in ("float32", "bfloat16")
    }


def test_a_swap_no_selected_model_has_fails_each_test_under_xdist(tmp_path: Path) -> None:
    code, output = _xdist(tmp_path / "reports", tmp_path, "--swap", "rms_norm=fused", "-k",
                          "tiny-gpt2")  # fmt: skip
    assert "INTERNALERROR" not in output, output[-3000:]
    assert code == 1, output[-3000:]  # 1: tests failed (3 was xdist's internal error)
    assert re.search(r"\b2 errors\b", output), output[-3000:]  # each test has its outcome
    usage = "numalign: --swap rms_norm=fused: no module of any model is one that rms_norm"
    assert output.count(usage) >= 2, output[-3000:]  # each test names the reason
    records = read_records(tmp_path / "reports" / "latest")
    assert {r.test_id for r in records} == _ids("tiny-gpt2")
    assert all(r.verdict == "error" and usage in (r.message or "") for r in records)


def test_a_swap_that_raises_in_a_test_is_that_tests_failure_under_xdist(tmp_path: Path) -> None:
    (tmp_path / "raising_swaps.py").write_text(RAISING, encoding="utf-8")
    code, output = _xdist(tmp_path / "reports", tmp_path, "--candidates", "raising_swaps",
                          "--swap", "rms_norm=raises", "-k", "tiny-llama")  # fmt: skip
    assert "INTERNALERROR" not in output, output[-3000:]
    assert code == 1, output[-3000:]
    assert re.search(r"\b2 failed\b", output), output[-3000:]
    records = read_records(tmp_path / "reports" / "latest")
    errors = [r for r in records if r.verdict == "error"]
    assert {r.test_id for r in errors} == _ids("tiny-llama")
    assert all("RuntimeError: planted: this kernel raises" in (r.message or "") for r in errors)


def test_an_operator_without_an_adapter_is_refused_when_the_swaps_are_read() -> None:
    """``--swap softmax=online`` (softmax: no module maps to it) is a usage error at
    configuration, on xdist's controller before any worker starts; it used to pass there and
    fail every test of every model at its load."""
    with pytest.raises(SwapError, match=r"^--swap softmax=online: operator softmax has no ada"):
        parse_swaps(["softmax=online"])
    # rotary has a function adapter, not a module one: swappable all the same
    assert parse_swaps(["rope_tables=complex"]) == [("rope_tables", "complex")]


def test_the_swap_check_never_raises_on_a_model_it_cannot_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session's check (at collection, in each xdist worker) judges nothing where a set's
    model cannot be built on the meta device, whatever that raises: the set's tests load the
    model and fail or skip with their own message (an exception here ended the session)."""
    from numalign.replay import swap

    sets = [str(ROOT / "golden" / "sets" / "tiny-gpt2")]
    swaps = [("rms_norm", "fused")]
    assert swap.unmatched_in_sets(sets, swaps)  # GPT-2 has no RMSNorm: a usage error

    def cannot_build(model_dir: object) -> set[str]:
        raise RuntimeError("cannot build this model on the meta device")

    monkeypatch.setattr(swap, "module_types", cannot_build)
    assert swap.unmatched_in_sets(sets, swaps) == []
    assert swap.unmatched_in_sets([str(tmp_path / "no-such-set")], swaps) == []
