"""Swaps that fit any model: a swapped module keeps the original's parameters and attributes
visible (Mamba-2 reads ``self.norm.weight.dtype``); the RMSNorm adapter finds a (1 + weight)
norm by what it computes (Qwen3.5's, named like no known zero-centered family), and the
LayerNorm operator a LayerNorm without a bias (Cohere's), not T5's RMSNorm; a gated norm
is named as the form the operator lacks; a swap that matches no module of any replayed model
is a usage error before any test runs, and a model without it among others skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from numalign.golden.zoo import rescale
from numalign.ops.registry import OPERATORS, load_catalogue
from numalign.replay.swap import apply_swaps, swapped_as, unmatched_message
from numalign.sweep.build import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _tiny(model_type: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    rescale(model, gemma_norms=None)
    return model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 11)[None]).logits


def test_a_swapped_norm_keeps_the_original_attributes_visible() -> None:
    model = _tiny("mamba2")
    before = _logits(model)
    originals = {n: m for n, m in model.named_modules() if type(m).__name__ == "Mamba2RMSNorm"}
    swapped = apply_swaps(model, [("rms_norm", "fused")])
    assert sorted(swapped) == sorted(originals)
    for name, original in originals.items():
        module = model.get_submodule(name)
        assert module is original and swapped_as(module) is not None  # swapped in place
        assert module.weight is original.weight  # what the model reads (weight.dtype)
    # an honest fused RMSNorm in float32: the logits agree to float32 reordering (1e-4 on
    # logits of order ten; a missing weight or epsilon moves them by whole units)
    assert float((_logits(model) - before).abs().max()) < 1e-4


@pytest.mark.parametrize(
    "model_type",
    [
        "qwen3_5_text",  # 1 + weight, named like no known zero-centered family
        "gemma3_text",  # 1 + weight, named Gemma
        "gemma4_text",  # named Gemma but weight alone, and norms without a scale
    ],
)
def test_the_rms_adapter_finds_each_norm_form_by_what_it_computes(model_type: str) -> None:
    model = _tiny(model_type)
    before = _logits(model)
    norms = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    scaleless = [n for n, m in norms if getattr(m, "weight", None) is None]
    swapped = apply_swaps(model, [("rms_norm", "fused")])  # the adapter's probe check passes
    assert any(name.endswith("input_layernorm") for name in swapped)
    assert not set(scaleless) & set(swapped)  # a norm without a scale keeps its own forward
    assert bool(scaleless) == (model_type == "gemma4_text")  # Gemma 4's v_norm has none
    # as above: float32 reordering only (a wrong form multiplies by about 0, or by 2)
    assert float((_logits(model) - before).abs().max()) < 1e-4


@pytest.mark.parametrize("model_type", ["cohere", "cohere2"])
def test_a_layer_norm_without_a_bias_is_one_layer_norm_stands_for(model_type: str) -> None:
    """Cohere's LayerNorm (``CohereLayerNorm``: weight, no bias, ``variance_epsilon``) is a
    LayerNorm by what it computes, so ``layer_norm`` swaps it (the day-0 sweep could plant no
    norm in the Cohere family before)."""
    model = _tiny(model_type)
    before = _logits(model)
    swapped = apply_swaps(model, [("layer_norm", "var_mean")])  # the adapter's probe passes
    assert any(name.endswith("input_layernorm") for name in swapped)
    assert all(swapped_as(model.get_submodule(n)) is not None for n in swapped)
    # float32 reordering only: Welford statistics against the two-pass ones (1e-4 on logits
    # of order ten; a norm that added a bias or dropped the weight moves them by order one)
    assert float((_logits(model) - before).abs().max()) < 1e-4


def test_a_norm_over_groups_of_channels_keeps_its_own_forward() -> None:
    """Qwen4-Exp's hyper-connection norm (``Qwen4ExpTextRMSNorm`` with ``group_size``) takes
    its statistics per group of channels, a form the rms_norm adapter lacks: it keeps its own
    forward, and the model's whole-width RMSNorms (its attention's per-head ones) are swapped
    (the sweep's planted swap refused the whole model: "the adapter does not reproduce ...
    hc_norm")."""
    model = _tiny("qwen4_exp_text")
    before = _logits(model)
    grouped = [n for n, m in model.named_modules() if getattr(m, "group_size", None)]
    swapped = apply_swaps(model, [("rms_norm", "fused")])
    assert grouped and not set(grouped) & set(swapped)
    assert any(name.endswith("self_attn.q_norm") for name in swapped)  # per head, whole width
    # float32 reordering only, as above
    assert float((_logits(model) - before).abs().max()) < 1e-4


def test_a_norm_whose_weight_is_a_dummy_buffer_keeps_its_own_forward() -> None:
    """Falcon-Mamba's ``FalconMambaWeightlessRMSNorm`` holds a ``weight`` buffer of ones of
    another size than it normalizes (only "for imitating the kernels path"): the adapter reads
    a scale from parameters alone, so that norm keeps its own forward (the sweep's planted
    swap crashed on it) while the model's real RMSNorms are swapped."""
    model = _tiny("falcon_mamba")
    before = _logits(model)
    swapped = apply_swaps(model, [("rms_norm", "fused")])
    types = {type(model.get_submodule(n)).__name__ for n in swapped}
    assert types == {"FalconMambaRMSNorm"}
    # float32 reordering only, as above
    assert float((_logits(model) - before).abs().max()) < 1e-4


def test_a_module_named_layer_norm_that_is_an_rms_norm_is_not_one() -> None:
    """T5's ``T5LayerNorm`` is an RMSNorm (no mean subtracted): the name pattern alone would
    claim it; what it computes does not, on real weights (a probe) and on meta ones (the
    inventory's: the forward's source)."""
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    load_catalogue()
    layer_norm = OPERATORS["layer_norm"]
    assert layer_norm.stands_for("T5LayerNorm")  # the name matches the pattern
    assert not layer_norm.stands_for_module(T5LayerNorm(16))
    with torch.device("meta"):
        assert not layer_norm.stands_for_module(T5LayerNorm(16))
        assert layer_norm.stands_for_module(torch.nn.LayerNorm(16))
    assert layer_norm.stands_for_module(torch.nn.LayerNorm(16))


def test_a_gated_norm_is_named_as_the_form_the_operator_lacks() -> None:
    load_catalogue()
    text = unmatched_message(OPERATORS["rms_norm"], "fused", {"Qwen3NextRMSNormGated", "Linear"})
    assert text == (
        "--swap rms_norm=fused: no module of this model is one that rms_norm stands for "
        "(*RMSNorm); it has Qwen3NextRMSNormGated, a form of it that rms_norm lacks (a gated or "
        "otherwise extended module: an operator of that form is needed to swap it)"
    )


def _suite(reports: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(ROOT / "suites" / "models" / "test_model.py"),
         "--rootdir", str(ROOT), "-p", "no:cacheprovider", "-q", "--dtype", "float32",
         "--report-dir", str(reports), *args],
        capture_output=True, text=True, env=env, cwd=ROOT / "tests", check=False, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("selection", ["tiny-gpt2", "tiny-bert"])
def test_a_swap_that_matches_no_replayed_model_is_a_usage_error(
    selection: str, tmp_path: Path
) -> None:
    result = _suite(tmp_path, "--swap", "rms_norm=fused", "-k", selection)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout[-2000:]
    assert not list(tmp_path.iterdir())  # no test ran, nothing was written
    assert "ERROR: numalign: --swap rms_norm=fused: no module of any model is one that " \
        "rms_norm stands for (*RMSNorm)" in result.stderr  # fmt: skip


def test_a_model_without_the_swapped_module_skips_among_others(tmp_path: Path) -> None:
    result = _suite(tmp_path, "--swap", "rms_norm=fused", "-k", "tiny-gpt2 or tiny-llama", "-rs")
    assert result.returncode == 0, result.stdout[-2000:]
    assert "1 passed, 1 skipped" in result.stdout
    assert "no module of this model is one that rms_norm stands for" in result.stdout
