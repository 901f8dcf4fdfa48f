"""The operator registry: registration, lookups with "did you mean", skips, entry points."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import numalign
from numalign.ops.cases import Case
from numalign.ops.registry import OPERATORS, RegistryError, candidates, load_catalogue

ROOT = Path(__file__).resolve().parents[1]


def test_the_catalogue_covers_the_operator_families() -> None:
    load_catalogue()
    expected = {
        "linear", "matmul", "rms_norm", "layer_norm", "add_rms_norm", "rope_neox", "rope_gptj",
        "rope_partial", "mrope", "silu", "gelu_erf", "gelu_tanh", "swiglu", "geglu", "softmax",
        "attention", "paged_kv_gather", "paged_attention", "moe_routing", "moe_experts",
        "cumsum", "segment_sum", "topk", "sort", "block_topk", "block_sparse_attention",
        "linear_attention", "gated_delta_rule", "causal_conv1d", "patch_embed", "embedding",
        "quantize_int8", "dequantize_int8", "quantize_fp8", "dequantize_fp8",
    }  # fmt: skip
    assert expected <= set(OPERATORS)


def test_every_operator_has_a_builtin_candidate_and_cases_at_every_tier() -> None:
    load_catalogue()
    for name, op in OPERATORS.items():
        builtin = [c for c in candidates(name).values() if c.module.startswith("operators.")]
        assert builtin, f"{name} has no built-in candidate"
        assert op.cases_for("smoke"), f"{name} has no smoke case"
        names = [c.name for c in op.cases]
        assert len(names) == len(set(names)), f"{name} repeats a case name"


def test_unknown_operator_suggests_the_closest_name() -> None:
    message = r"Unknown operator 'rms_nrom'\. Did you mean 'rms_norm'"
    with pytest.raises(RegistryError, match=message):
        numalign.candidate("rms_nrom", name="x")(lambda x: x)
    with pytest.raises(RegistryError, match="Did you mean 'attention'"):
        candidates("atention")


def test_a_candidate_name_cannot_be_registered_twice() -> None:
    numalign.candidate("silu", name="test_twice")(lambda x: x)
    with pytest.raises(RegistryError, match="'test_twice' is already registered"):
        numalign.candidate("silu", name="test_twice")(lambda x: x * 1)


def test_skip_reasons_name_the_device_dtype_or_case() -> None:
    numalign.candidate("silu", name="test_cuda_bf16", devices=["cuda"], dtypes=["bfloat16"])(
        lambda x: x
    )
    cand = candidates("silu")["test_cuda_bf16"]
    case = Case("c", {"shape": (1,)})
    assert cand.skip_reason("cpu", "bfloat16", case) == (
        "candidate silu/test_cuda_bf16 does not run on cpu"
    )
    assert cand.skip_reason("cuda", "float16", case) == (
        "candidate silu/test_cuda_bf16 does not support float16"
    )
    assert cand.skip_reason("cuda", "bfloat16", case) is None


def test_entry_point_candidates_are_loaded(tmp_path: Path) -> None:
    """A vendor package that declares the numalign.candidates entry point."""
    (tmp_path / "vendor_ep_kernels.py").write_text(
        textwrap.dedent(
            """
            import numalign, torch
            @numalign.candidate("silu", name="vendor_ep")
            def silu(x):
                return torch.nn.functional.silu(x)
            """
        )
    )
    dist = tmp_path / "vendor_ep-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vendor-ep\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[numalign.candidates]\nvendor = vendor_ep_kernels\n")
    code = "from numalign.ops.registry import candidates; print('vendor_ep' in candidates('silu'))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "True"


def test_unsupported_candidates_are_skipped_with_the_reason(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        only_cuda="""
import numalign
@numalign.candidate("silu", name="only_cuda", devices=["cuda"])
def silu(x):
    return x
"""
    )
    pytester.syspathinsert()
    suite = ROOT / "suites" / "operators" / "test_operators.py"
    result = pytester.runpytest_subprocess(
        str(suite), "--candidates", "only_cuda", "--device", "cpu", "--tier", "smoke",
        "-k", "only_cuda", "-rs", "--rootdir", str(ROOT), "-p", "no:cacheprovider",
    )  # fmt: skip
    result.stdout.fnmatch_lines(["*SKIPPED*candidate silu/only_cuda does not run on cpu*"])
    # every selected suite test skipped: nothing was tested, and the session says so (5)
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.stdout.fnmatch_lines(["*numalign: * none ran (all skipped: *does not run on cpu*"])


def test_a_failing_catalogue_module_is_named_taken_back_and_retried(tmp_path: Path) -> None:
    """An entry point that registers a candidate, then raises: the error names it, the
    candidate is not kept, and the next use loads again (and succeeds once it is fixed)."""
    (tmp_path / "broken_kernels.py").write_text(
        textwrap.dedent(
            """
            import os, numalign, torch
            @numalign.candidate("silu", name="half_loaded")
            def silu(x):
                return torch.nn.functional.silu(x)
            if not os.path.exists(os.environ["FIXED"]):
                raise ImportError("no such extension: vendor_ops")
            """
        )
    )
    dist = tmp_path / "broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[numalign.candidates]\nbroken = broken_kernels\n")
    code = textwrap.dedent(
        """
        import os, pathlib, sys
        from numalign.ops.registry import RegistryError, candidates
        try:
            candidates("silu")
        except RegistryError as exc:
            print("ERROR", exc)
        sys.modules.pop("broken_kernels", None)
        pathlib.Path(os.environ["FIXED"]).touch()
        print("RETRY", "half_loaded" in candidates("silu"))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={
            "PYTHONPATH": f"{tmp_path}:{ROOT}",
            "PATH": "/usr/bin:/bin",
            "FIXED": str(tmp_path / "fixed"),
        },
        capture_output=True,
        text=True,
        check=True,
    )
    error, retry = out.stdout.strip().splitlines()
    assert "entry point broken (broken_kernels) raised ImportError: no such extension" in error
    assert retry == "RETRY True"  # loaded whole on the next use, without a name clash
