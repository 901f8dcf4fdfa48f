"""The operators of the newest models (MLA, attention sinks, block-scaled FP8, int4 weights,
quantized KV caches): the real suite, in a subprocess, catches each planted wrong kernel on
the case that exposes it and passes it where its bug is invisible, and passes the correct but
different kernels in every dtype; the quantizers' round trips stay within half a step of the
format; the float64 forms of each operator agree; the HF module names are real."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from suite_runner import assert_passes_in_every_dtype, run_operator_suite

from numalign.ops.cases import Case
from numalign.ops.registry import OPERATORS, candidates
from numalign.records.drift import DriftRecord
from operators import fp8_block, int4, kv_quant, mla, sinks

#: wrong kernel -> (operator, the case that must expose it, a case where the bug is invisible
#: and which it must therefore pass)
WRONG = {
    "wrong_mla_no_mscale": ("mla", "yarn-scale-1x4x9x40-r512", "prefill-1x4x33x33-r256"),
    "wrong_mla_kv_split": ("mla", "prefill-1x4x33x33-r256", "one-1x1x1x1-r8"),
    "wrong_sink_kv_head": ("attention_sinks", "gqa-1x8x1x33x33x64", "window-1x4x4x80x80x32"),
    "wrong_sink_window_off_by_one": (
        "attention_sinks",
        "window-1x4x4x80x80x32",
        "gqa-1x8x1x33x33x64",
    ),
    "wrong_fp8_tail_group": ("fp8_block_quant", "act-unaligned-33x4097", "act-8x4096"),
    "wrong_fp8_weight_scale_n": ("fp8_block_gemm", "blocks-4x512x256", "outliers-16x1024x128"),
    "wrong_int4_sign_extension": (
        "int4_dequant",
        "gptq-4x256x512-int32",
        "bytes-4x256x512-uint8",
    ),
    "wrong_int4_group_128": ("int4_gemm", "group32-2x64x256-uint8", "gptq-4x256x512-int32"),
    "wrong_kv_e5m2": ("kv_quant", "fp8-head-2x4x33x64", "int8-token-2x4x33x128"),
    "wrong_kv_scale_gqa": (
        "kv_quant_attention",
        "int8-token-prefill-1x4x2x33x33x64",
        "fp8-token-padded-2x4x1x17x17x32",
    ),
}
#: correct but different kernel -> its operator
RIGHT = {
    "right_mla_absorbed_f32": "mla",
    "right_sink_lse": "attention_sinks",
    "right_fp8_gemm_dequant_f32": "fp8_block_gemm",
    "right_int4_lut": "int4_gemm",
    "right_kv_dequant_lut": "kv_dequant",
}
NEW_OPERATORS = (
    "mla", "attention_sinks", "fp8_block_quant", "fp8_block_dequant", "fp8_block_gemm",
    "int4_dequant", "int4_gemm", "kv_quant", "kv_dequant", "kv_quant_attention",
)  # fmt: skip


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[DriftRecord]]:
    """One run of the real suite at tier pr, all dtypes, over this file's planted kernels."""
    kernels = [(name, op) for name, (op, _, _) in WRONG.items()] + list(RIGHT.items())
    return run_operator_suite(tmp_path_factory.mktemp("vendor"), kernels)


def _failed_cases(output: str, operator: str, name: str) -> set[str]:
    return set(re.findall(rf"FAILED \S+::test_{operator}\[{name}-\w+-([^\]]+)\]", output))


@pytest.mark.parametrize("name", sorted(WRONG))
def test_each_wrong_kernel_fails_on_the_case_that_exposes_it(
    suite_run: tuple[str, list[DriftRecord]], name: str
) -> None:
    output, records = suite_run
    operator, case, _ = WRONG[name]
    failed = _failed_cases(output, operator, name)
    assert case in failed, f"{name} did not fail on {case}: {sorted(failed)}\n{output[-3000:]}"
    mine = [r for r in records if r.candidate == name and r.case == case]
    assert any(r.verdict == "failed" for r in mine)


@pytest.mark.parametrize("name", sorted(WRONG))
def test_each_wrong_kernel_passes_where_its_bug_is_invisible(
    suite_run: tuple[str, list[DriftRecord]], name: str
) -> None:
    """The suite flags the bug, not the kernel: where the bug cannot show, it passes."""
    output, records = suite_run
    operator, _, invisible = WRONG[name]
    assert invisible not in _failed_cases(output, operator, name)
    mine = [r for r in records if r.candidate == name and r.case == invisible]
    # one test per dtype (a quantizer's records carry its outputs' dtypes, not the run's)
    assert len({r.test_id for r in mine}) == 3
    assert all(r.verdict == "passed" for r in mine)


def test_the_e5m2_cache_fails_on_its_codes_by_the_rounding_rule(
    suite_run: tuple[str, list[DriftRecord]],
) -> None:
    """Its scales are right; its codes, decoded as the declared E4M3, are far off x / scale."""
    _, records = suite_run
    _, case, _ = WRONG["wrong_kv_e5m2"]
    mine = [r for r in records if r.candidate == "wrong_kv_e5m2" and r.case == case]
    codes = [r for r in mine if r.point == "kv_quant.codes"]
    assert len(codes) == 3 and all(r.verdict == "failed" for r in codes)
    assert {r.rule for r in codes} <= {"rounding", "non-finite"}
    assert all(r.verdict == "passed" for r in mine if r.point == "kv_quant.scale")


@pytest.mark.parametrize("name", RIGHT)
def test_each_correct_but_different_kernel_passes_in_every_dtype(
    suite_run: tuple[str, list[DriftRecord]], name: str
) -> None:
    assert_passes_in_every_dtype(*suite_run, name)


# --- the catalogue entries --------------------------------------------------------------------
def test_every_new_operator_has_smoke_pr_and_nightly_cases_and_two_candidates() -> None:
    for name in NEW_OPERATORS:
        op = OPERATORS[name]
        smoke, pr, nightly = (len(op.cases_for(t)) for t in ("smoke", "pr", "nightly"))
        # a few at smoke (the one-minute gate), more at pr, the largest only at nightly
        assert 3 <= smoke <= 5 < pr < nightly, (name, smoke, pr, nightly)
        assert [c for c in op.cases if "empty" in c.name], name
        assert [c for c in op.cases if c.get("noncontiguous")], name
        assert len(candidates(name)) >= 2, name


def test_hf_module_names_are_transformers_classes() -> None:
    from transformers.integrations.finegrained_fp8 import FP8Linear
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    assert OPERATORS["mla"].stands_for(DeepseekV3Attention.__name__)
    assert OPERATORS["mla"].stands_for(DeepseekV2Attention.__name__)
    assert OPERATORS["attention_sinks"].stands_for(GptOssAttention.__name__)
    assert OPERATORS["fp8_block_gemm"].stands_for(FP8Linear.__name__)
    # none of these modules is one activation in, one out: no adapter, no --swap
    assert all(OPERATORS[n].adapter is None for n in NEW_OPERATORS)


# --- formats ----------------------------------------------------------------------------------
@pytest.mark.parametrize("container", [torch.int32, torch.uint8])
def test_int4_packing_round_trips_every_nibble_including_the_sign_nibble(
    container: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 37), generator=gen)  # 37: a partly filled last word
    codes[0, 7] = 15  # nibble 7 of word 0 set: a negative int32
    packed = int4.pack_int4(codes, container)
    assert packed.dtype == container and packed.shape == (5, -(-37 // int4.PER_WORD[container]))
    if container == torch.int32:
        assert int(packed[0, 0]) < 0
    assert torch.equal(int4.unpack_int4(packed, 37), codes)


def test_int4_word_layout_is_gptq_order() -> None:
    """Nibble j of a word holds column 8w + j: 0x76543210 unpacks to 0..7."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert int4.unpack_int4(word, 8).tolist() == [list(range(8))]
    byte = torch.tensor([[0x21]], dtype=torch.uint8)
    assert int4.unpack_int4(byte, 2).tolist() == [[1, 2]]


def test_adjacent_e4m3_values_have_adjacent_codes() -> None:
    """E4M3 bits are sign and magnitude: one step of the format is one code (what the
    planted truncating kernels step down by)."""
    positive = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN in E4M3fn
    ascending = fp8_block.decode_fp8(positive, torch.float64)
    assert bool((ascending[1:] > ascending[:-1]).all())
    assert torch.equal(fp8_block.encode_fp8(ascending), positive)
    assert torch.equal(fp8_block.encode_fp8(-ascending[1:]), positive[1:] | 0x80)
    assert float(ascending[-1]) == fp8_block.FP8_MAX


def _e4m3_step(y: torch.Tensor) -> torch.Tensor:
    """The spacing of E4M3 values around |y|: 2**(e - 3), subnormals 2**-9."""
    exponent = torch.floor(torch.log2(y.abs().clamp_min(2.0**-6)))
    return torch.exp2(exponent - 3)


def _round_trip_in_steps(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                         fmt: str) -> torch.Tensor:  # fmt: skip
    """|dequant(quant(x)) - x| in units of the format's step at x (float64)."""
    y = x.double() / scale.double()
    values = fp8_block.decode_fp8(codes, torch.float64) if fmt == "fp8" else codes.double()
    step = _e4m3_step(y) if fmt == "fp8" else torch.ones_like(y)
    return (values - y).abs() / step


#: Round-to-nearest leaves at most half a step; x / scale taken in float32 adds at most
#: |y| * 2**-23 <= 16 * 2**-23 steps (|y| < 16 steps in E4M3, < 128 in int8: 2**-16 at most),
#: so a tie decided the other way still lands within this, and truncation (up to one step)
#: does not.
HALF_STEP = 0.5 + 2.0**-16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["torch", "reciprocal"])
def test_fp8_block_quantizers_round_trip_within_half_a_step(name: str, dtype: torch.dtype) -> None:
    fn = candidates("fp8_block_quant")[name].fn
    for block in (fp8_block.ACT_BLOCK, fp8_block.WEIGHT_BLOCK):
        case = Case("t", {"rows": 200, "cols": 300, "block": block}, regime="outliers")
        x = fp8_block.fp8_quant_inputs(case, torch.Generator().manual_seed(1))["x"].to(dtype)
        codes, scale = fn(x, *block)
        full = fp8_block.expand_scale(scale, x.shape, block)
        assert float(_round_trip_in_steps(x, codes, full, "fp8").max()) <= HALF_STEP


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["torch", "reciprocal"])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_kv_quantizers_round_trip_within_half_a_step(
    fmt: str, name: str, dtype: torch.dtype
) -> None:
    fn = candidates("kv_quant")[name].fn
    x = torch.randn(2, 4, 50, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    for granularity in kv_quant.REDUCED:
        codes, scale = fn(x, fmt, granularity)
        assert float(_round_trip_in_steps(x, codes, scale, fmt).max()) <= HALF_STEP


def test_truncation_breaks_the_half_step_property() -> None:
    """The property above has teeth: a kernel that truncates instead of rounding fails it
    (as it fails the suite's rounding rule: see test_case_grid_gaps.py)."""
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    _, scale = fp8_block.fp8_block_quant_reference(x, *fp8_block.ACT_BLOCK)
    full = fp8_block.expand_scale(scale, x.shape, fp8_block.ACT_BLOCK)
    y = x / full
    truncated = torch.sign(y) * torch.floor(y.abs() / _e4m3_step(y)) * _e4m3_step(y)
    codes = fp8_block.encode_fp8(truncated)
    # truncation leaves a uniform fraction of a step: over 1024 values the worst is within
    # 1/1024 of a whole step, far past the half step (+2**-16) that rounding to nearest keeps
    assert float(_round_trip_in_steps(x, codes, full, "fp8").max()) > 0.9


def test_int4_quantizer_round_trips_within_one_step() -> None:
    """Min-max quantization with a rounded zero point: inside the range the error is half a
    step; at the range's ends the rounded zero can push a value out by up to half a step,
    where it clips: one step at most."""
    w = torch.randn(16, 300, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    qweight, qzeros, scales = int4.quantize_int4(w, 64, torch.int32)
    back = int4.dequant_reference(qweight, qzeros, scales, 64, 300)
    step = scales.repeat_interleave(64, -1)[:, :300]
    assert float(((back - w).abs() / step).max()) <= 1.0 + 1e-12  # float64 rounding only


# --- float64 agreement of the forms ---------------------------------------------------------
def _float64_inputs(op_name: str, case_name: str) -> dict[str, Any]:
    op = OPERATORS[op_name]
    case = next(c for c in op.cases if c.name == case_name)
    made = op.make_inputs(case, torch.Generator().manual_seed(5))
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in made.items()}  # fmt: skip


#: Two float64 evaluations of one function in different association orders: relative L2
#: differences of order 1e-15; 1e-12 leaves room for the longest reductions here (512 terms).
FLOAT64_AGREEMENT = 1e-12


@pytest.mark.parametrize(
    ("op_name", "form", "case_name"),
    [
        ("mla", mla.mla_absorbed, "decode-2x4x1x80-r128"),
        ("mla", mla.mla_absorbed, "padded-2x4x17x17-r128"),
        ("mla", mla.mla_naive_sdpa, "prefill-1x4x33x33-r256"),
        ("attention_sinks", sinks.attention_sinks_tiled, "decode-window-2x8x1x1x300x64"),
        ("attention_sinks", sinks.attention_sinks_tiled, "padded-2x4x1x17x17x32"),
    ],
)
def test_optimized_forms_are_the_same_function_in_float64(
    op_name: str, form: object, case_name: str
) -> None:
    """The weight absorption and the sink-seeded online softmax are algebra, not
    approximations: in float64 they agree with the reference to rounding."""
    inputs = _float64_inputs(op_name, case_name)
    expected = OPERATORS[op_name].reference(**inputs)
    actual = form(**inputs)  # type: ignore[operator]
    assert actual.dtype == torch.float64
    error = float((actual - expected).norm() / expected.norm().clamp_min(1e-300))
    assert error <= FLOAT64_AGREEMENT, error


def test_sink_rows_with_every_key_masked_are_zero_and_finite() -> None:
    inputs = _float64_inputs("attention_sinks", "padded-2x4x1x17x17x32")
    out = sinks.attention_sinks_reference(**inputs)
    assert bool(out.isfinite().all())
    assert float(out[1, :, :5].abs().max()) == 0.0  # batch 1 pads its first 5 positions
    assert float(out[1, :, 5:].abs().min()) > 0.0


def test_all_zero_blocks_get_scale_one_and_zero_codes() -> None:
    x = torch.zeros(3, 130)
    codes, scale = fp8_block.fp8_block_quant_reference(x, *fp8_block.ACT_BLOCK)
    assert torch.equal(scale, torch.ones(3, 2)) and int(codes.max()) == 0
    codes, scale = kv_quant.kv_quant_reference(torch.zeros(1, 2, 0, 8), "int8", "head")
    assert codes.shape == (1, 2, 0, 8) and torch.equal(scale, torch.ones(1, 2, 1, 1))
    assert math.isfinite(float(scale.sum()))
