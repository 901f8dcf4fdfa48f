"""Compiled backends (``--compile``) through the real suites (pytester, in a subprocess):
a planted wrong kernel stays caught when compiled, in the operator suite and swapped into a
model; the compiled zoo model passes with Inductor (a false-alarm check); a compilation
error is a failing test with the backend's message, never a crashed session; graph breaks
warn and are counted; records name the backend and keep compile time apart; an unknown
backend is a usage error naming the registered ones. And drift.html puts a compiled run
beside an eager one.

The mechanism is exercised with ``aot_eager`` (Dynamo and AOTAutograd without code
generation: seconds per compilation); Inductor, which compiles C++ (tens of seconds per
model on CPU), runs once, on one zoo model in one dtype. The full zoo in three dtypes is
the nightly's (``ci/nightly.sh``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from numalign.records.drift import DriftRecord, read_records

ROOT = Path(__file__).resolve().parents[2]

KERNELS = '''
import torch
import numalign
from operators.norms import rms_norm_reference
from operators._common import up

@numalign.candidate("rms_norm", name="wrong_eps")
def wrong_eps(x, weight, eps, offset=0.0):
    """An epsilon of 1e-2 where the case says otherwise."""
    return rms_norm_reference(x, weight, 1e-2, offset)

@numalign.candidate("rms_norm", name="right_fused")
def right_fused(x, weight, eps, offset=0.0):
    xf = up(x)
    inv = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * inv * (offset + up(weight))).to(x.dtype)

@numalign.candidate("rms_norm", name="right_breaks")
def right_breaks(x, weight, eps, offset=0.0):
    """Correct, with a graph break in the middle (code Dynamo does not trace)."""
    xf = up(x)
    inv = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    torch._dynamo.graph_break()
    return (xf * inv * (offset + up(weight))).to(x.dtype)

@numalign.candidate("rms_norm", name="bad_eps")
def bad_eps(x, weight, eps, offset=0.0):
    return rms_norm_reference(x, weight, 1e-2, offset)
'''

BROKEN_BACKEND = '''
import torch

@torch._dynamo.register_backend(name="numalign_broken")
def numalign_broken(gm, example_inputs):
    """A vendor compiler that cannot lower anything."""
    raise NotImplementedError("vendor lowering: no kernel for this graph (planted)")
'''


def _run(tmp_path: Path, suite: str, *args: str, timeout: int = 600) -> tuple[str, int]:
    """The real suite in a subprocess (``-n 0``: one compilation per process is the point of
    the per-worker cache, and two workers would each compile), with the kernels above and the
    broken backend importable."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "compiled_kernels.py").write_text(KERNELS)
    (tmp_path / "broken_backend.py").write_text(BROKEN_BACKEND)
    path = os.pathsep.join(p for p in (str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "suites" / suite), "-p",
           "no:cacheprovider", "-q", "--tb=line", "-rfw", "--candidates", "compiled_kernels",
           "--report-dir", str(tmp_path / "reports"), *args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    return proc.stdout + proc.stderr, proc.returncode


def _records(tmp_path: Path) -> list[DriftRecord]:
    return read_records(tmp_path / "reports" / "latest")


@pytest.fixture(scope="module")
def operator_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[DriftRecord]]:
    """rms_norm at tier smoke in bfloat16, every candidate compiled with aot_eager."""
    tmp = tmp_path_factory.mktemp("ops")
    output, _ = _run(
        tmp, "operators", "--compile", "aot_eager", "--tier", "smoke", "--dtype", "bfloat16",
        "-k", "test_rms_norm and (wrong_eps or right_fused or right_breaks)",
    )  # fmt: skip
    return output, _records(tmp)


def test_a_wrong_kernel_stays_caught_when_compiled(
    operator_run: tuple[str, list[DriftRecord]],
) -> None:
    output, records = operator_run
    failed = set(re.findall(r"FAILED \S+::test_rms_norm\[wrong_eps-bfloat16-([^\]]+)\]", output))
    assert "small-16x4096" in failed, output[-3000:]  # the case that exposes it eager too
    assert not re.findall(r"FAILED \S+\[right_", output), output[-3000:]
    mine = [r for r in records if r.candidate in ("wrong_eps", "right_fused", "right_breaks")]
    assert mine and {r.swap for r in mine} == {"compile=aot_eager"}
    assert all(r.verdict == "passed" for r in mine if r.candidate.startswith("right_"))


def test_compile_time_is_recorded_apart_and_artifacts_are_reused(
    operator_run: tuple[str, list[DriftRecord]],
) -> None:
    _, records = operator_run
    fused = [r for r in records if r.candidate == "right_fused"]
    compiled = [r for r in fused if (r.compile_s or 0.0) > 0.0]
    # the first case compiles; other cases of one candidate and dtype reuse the compiled
    # function (seven smoke cases, a recompilation for the first new size at most, and
    # sizes after that symbolic): at most half of them may compile
    assert compiled and len(compiled) <= len(fused) // 2, [(r.case, r.compile_s) for r in fused]
    assert all(r.duration_s is not None and r.duration_s >= 0.0 for r in fused)


def test_graph_breaks_warn_and_are_counted(operator_run: tuple[str, list[DriftRecord]]) -> None:
    output, records = operator_run
    assert "GraphBreakWarning" in output and "graph break(s) under compile=aot_eager" in output
    breaks = [r.graph_breaks for r in records if r.candidate == "right_breaks"]
    assert any((b or 0) >= 1 for b in breaks), breaks


def test_a_compilation_error_fails_the_test_with_the_backend_message(tmp_path: Path) -> None:
    output, code = _run(
        tmp_path, "operators", "--compile", "numalign_broken", "--device-plugin",
        "broken_backend", "--tier", "smoke", "--dtype", "bfloat16",
        "-k", "test_rms_norm and right_fused and (one-1x1 or tiny-3x8)",
    )  # fmt: skip
    assert code == 1, output[-3000:]  # tests failed; not an internal error (3) or a crash
    assert "failed to compile with torch.compile backend 'numalign_broken'" in output
    assert "vendor lowering: no kernel for this graph (planted)" in output
    assert "2 failed" in output, output[-2000:]  # the session went on to the second test
    errors = [r for r in _records(tmp_path) if r.verdict == "error"]
    assert len(errors) == 2 and {r.error for r in errors} == {"CompileError"}
    assert {r.swap for r in errors} == {"compile=numalign_broken"}


def test_an_unknown_backend_is_a_usage_error_naming_the_registered_ones(tmp_path: Path) -> None:
    output, code = _run(tmp_path, "models", "--compile", "nope", "--collect-only")
    assert code == 4, output[-2000:]  # pytest's usage error
    assert "unknown --compile backend 'nope'; registered: " in output
    assert "inductor" in output and "aot_eager" in output and "--device-plugin" in output


def test_the_compiled_zoo_model_replays_and_a_swapped_wrong_norm_is_located(
    tmp_path: Path,
) -> None:
    """tiny-llama in bfloat16, the whole model compiled with aot_eager, passes; with a wrong
    RMSNorm swapped in, the compiled model fails in float32 where eager does, and the first
    divergence is that norm, local (its compiled module alone fails too). One dtype each: a
    dtype is one more compilation of the same path (the suites' own runs cover the dtypes)."""
    honest, code = _run(tmp_path / "honest", "models", "--compile", "aot_eager", "--dtype",
                        "bfloat16", "-k", "test_model and tiny-llama and not deep")  # fmt: skip
    assert code == 0, honest[-3000:]
    records = _records(tmp_path / "honest")
    assert {r.dtype for r in records} == {"bfloat16"}
    assert {r.swap for r in records} == {"compile=aot_eager"}
    whole = [r for r in records if r.test_id.endswith("test_model[tiny-llama-bfloat16]")]
    assert whole and whole[0].compile_s and whole[0].graph_breaks == 0
    swapped, _ = _run(
        tmp_path / "swapped", "models", "--compile", "aot_eager", "--swap", "rms_norm=bad_eps",
        "--dtype", "float32", "-k", "tiny-llama and not deep and not test_decode and "
        "(test_model or layers.0.input_layernorm or layers.0.mlp)",
    )  # fmt: skip
    failed = set(re.findall(r"FAILED \S+::test_\w+\[(tiny-llama[\w./-]*)\]", swapped))
    assert failed == {"tiny-llama/model.layers.0.input_layernorm-float32",
                      "tiny-llama-float32"}, swapped[-3000:]  # fmt: skip
    located = [r.first_divergence for r in _records(tmp_path / "swapped") if r.first_divergence]
    assert located == [
        {"point": "model.layers.0.input_layernorm", "kind": "local", "request": "text-leftpad"}
    ]


def test_the_zoo_model_compiled_with_inductor_passes_its_calibrated_budgets(
    tmp_path: Path,
) -> None:
    """The false-alarm check with the real compiler: Inductor fuses and reorders (its logits
    differ from eager's), and the whole model still passes every point, the logits and the
    continuation within the calibrated bfloat16 budgets."""
    output, code = _run(tmp_path, "models", "--compile", "--dtype", "bfloat16", "-k",
                        "test_model and tiny-llama-bfloat16", timeout=900)  # fmt: skip
    assert code == 0 and "1 passed" in output, output[-3000:]
    records = _records(tmp_path)
    assert {r.swap for r in records} == {"compile=inductor"}
    assert any(r.mode == "logits" and r.verdict == "passed" for r in records)
