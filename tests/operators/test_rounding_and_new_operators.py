"""The rounding rule of quantized outputs, and the new operators' references against what
they stand for (transformers' rope-scaling functions, the sampling contract, the aten map)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from numalign.compare.rounding import ROUND_TO_NEAREST, expand_scale, judge_rounding
from numalign.ops.cases import Case, generator
from numalign.ops.check import make_inputs
from numalign.ops.inventory import aten_to_operators
from numalign.ops.registry import OPERATORS, CodeLayout, Output, load_catalogue

Q = Output("q", kind="quantized", quantized_from="x", scale_from="scale")
RULE, LAYOUT = Q.rounding, Q.layout_for(None)


def _int8(x: torch.Tensor, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(-1, keepdim=True) / 127
    v = x / scale
    q = torch.round(v) if rounding == "nearest" else torch.trunc(v)
    return q.to(torch.int8), scale


def test_round_to_nearest_passes_and_truncation_fails_by_share_of_off_by_one() -> None:
    x = torch.randn(8, 4096, generator=generator("rounding"), dtype=torch.float64)
    good = judge_rounding(*_int8(x, "nearest"), x, RULE, LAYOUT, name="q")
    assert good.passed and good.rule == "rounding"
    assert good.budget["off_by_one_share"] == 0.0
    bad = judge_rounding(*_int8(x, "trunc"), x, RULE, LAYOUT, name="q")
    assert not bad.passed
    # truncation rounds about half of the elements to the farther neighbour
    assert 0.4 < bad.budget["off_by_one_share"] < 0.6
    assert "farther neighbour" in bad.reason


def test_a_biased_rounding_with_few_flips_fails_by_its_bias() -> None:

    x = torch.randn(4, 1000, generator=generator("bias"), dtype=torch.float64)
    q, scale = _int8(x, "nearest")
    v = x / scale
    # round down the elements whose fraction lies in (0.45, 0.55): ~10% flips, all one way
    near_tie = (v - v.floor() - 0.5).abs() < 0.05
    q = torch.where(near_tie, v.floor(), q.to(torch.float64)).to(torch.int8)
    lenient = replace(ROUND_TO_NEAREST, off_by_one_share=1.0)
    result = judge_rounding(q, scale, x, lenient, LAYOUT, name="q")
    assert not result.passed
    assert "biased" in result.reason
    assert result.budget["bias_steps"] < -0.03  # about -0.05: half the flips, one step down


def test_two_steps_off_fails_and_a_zero_scale_is_not_finite() -> None:
    x = torch.linspace(-1, 1, 64, dtype=torch.float64)[None]
    q, scale = _int8(x, "nearest")
    q[0, 10] += 2
    assert "steps from x / scale" in judge_rounding(q, scale, x, RULE, LAYOUT, name="q").reason
    zero = judge_rounding(q, torch.zeros_like(scale), x, RULE, LAYOUT, name="q")
    assert not zero.passed and zero.rule == "non-finite"


def test_float8_values_are_judged_in_steps_of_their_grid() -> None:
    x = torch.randn(16, 256, generator=generator("fp8"), dtype=torch.float64)
    scale = x.abs().amax() / 448
    q = (x / scale).to(torch.float8_e4m3fn)
    assert judge_rounding(q, scale, x, RULE, LAYOUT, name="q").passed
    # one code toward zero everywhere the cast rounded away from zero
    away = q.to(torch.float64).abs() > (x / scale).abs()
    bits = torch.where(away, q.view(torch.uint8) - 1, q.view(torch.uint8))
    result = judge_rounding(bits.view(torch.float8_e4m3fn), scale, x, RULE, LAYOUT, name="q")
    assert not result.passed


def test_a_nan_float8_value_fails_as_non_finite() -> None:
    x = torch.linspace(-1, 1, 32, dtype=torch.float64)
    scale = x.abs().amax() / 448
    q = (x / scale).to(torch.float8_e4m3fn)
    q[3] = float("nan")
    result = judge_rounding(q, scale, x, RULE, LAYOUT, name="q")
    assert not result.passed and result.rule == "non-finite"


def test_block_scales_repeat_over_their_declared_blocks_with_a_partial_last_block() -> None:
    scale = torch.tensor([[1.0, 2.0, 3.0]])
    assert expand_scale(scale, (2, 5), (None, 2)).tolist() == [[1, 1, 2, 2, 3]] * 2
    # 33 groups of 128 over 4097 columns: the last group holds one column (a guess of
    # ceil(4097 / 33) = 125 columns per group would shift every scale after the first)
    groups = torch.arange(33.0)[None].expand(2, 33)
    full = expand_scale(groups, (2, 4097), (1, 128))
    assert full[0, 127] == 0 and full[0, 128] == 1 and full[0, 4095] == 31 and full[0, 4096] == 32
    blocks = expand_scale(
        torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), (300, 200), (128, 128)
    )
    assert blocks[255, 127] == 3 and blocks[256, 128] == 6
    assert expand_scale(torch.tensor(4.0), (2,)).tolist() == [4.0, 4.0]
    assert expand_scale(torch.tensor(4.0), (2, 3), (None, None)).shape == (2, 3)
    per_head = expand_scale(torch.tensor([1.0, 2.0]).view(1, 2, 1, 1), (3, 2, 5, 4),
                            (None, 1, None, None))  # fmt: skip
    assert per_head[2, 1, 4, 3] == 2 and per_head[2, 0, 4, 3] == 1
    with pytest.raises(ValueError, match=r"expected \(2, 33\)"):
        expand_scale(torch.ones(2, 32), (2, 4097), (1, 128))  # the tail's scale dropped
    with pytest.raises(ValueError, match=r"expected \(1, 2, 1, 1\)"):
        expand_scale(torch.ones(3, 2, 5, 1), (3, 2, 5, 4), (None, 1, None, None))
    with pytest.raises(ValueError, match="does not broadcast"):
        expand_scale(torch.ones(2), (2, 3))


def _fp8_case(rounding: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, E4M3 codes as uint8 bits, 1x128 group scales) of 4 x 300 values (a partial last
    group): rounded to nearest, or toward zero by one code where the cast rounded away."""
    x = torch.randn(4, 300, generator=generator("fp8 groups"), dtype=torch.float64)
    scale = torch.stack([x[:, i : i + 128].abs().amax(1) / 448 for i in (0, 128, 256)], 1)
    q = (x / expand_scale(scale, x.shape, (1, 128))).to(torch.float8_e4m3fn)
    bits = q.view(torch.uint8)
    if rounding == "toward zero":
        away = q.to(torch.float64).abs() > (x / expand_scale(scale, x.shape, (1, 128))).abs()
        bits = torch.where(away, bits - 1, bits)
    return x, bits, scale


GROUPS = CodeLayout("float8_e4m3fn", (1, 128))


def test_float8_bits_are_decoded_and_judged_on_the_declared_format_and_blocks() -> None:
    x, bits, scale = _fp8_case("nearest")
    good = judge_rounding(bits, scale, x, RULE, GROUPS, name="q")
    assert good.passed and good.dtype == "float8_e4m3fn", good.reason
    assert good.budget["off_by_one_share"] == 0.0
    # read as integers (the old way), the same codes are nonsense
    assert not judge_rounding(bits, scale, x, RULE, CodeLayout(None, (1, 128)), name="q").passed
    truncated = judge_rounding(*_fp8_case("toward zero")[1:], x, RULE, GROUPS, name="q")
    assert not truncated.passed and truncated.rule == "rounding"
    assert "farther neighbour" in truncated.reason


def test_codes_of_another_format_fail() -> None:
    x, _, scale = _fp8_case("nearest")
    v = x / expand_scale(scale, x.shape, (1, 128))
    e5m2 = judge_rounding(v.to(torch.float8_e5m2), scale, x, RULE, GROUPS, name="q")
    assert not e5m2.passed and e5m2.rule == "rounding"
    assert "not the declared float8_e4m3fn" in e5m2.reason
    # as uint8 bits the format cannot be told from the dtype: decoded as E4M3 they land far
    # off x / scale (E5M2 bits read as E4M3 are other values)
    e5m2_bits = judge_rounding(v.to(torch.float8_e5m2).view(torch.uint8), scale, x, RULE,
                               GROUPS, name="q")  # fmt: skip
    assert not e5m2_bits.passed and e5m2_bits.rule in ("rounding", "non-finite")
    int8 = CodeLayout("int8")
    q, row_scale = _int8(x, "nearest")
    assert judge_rounding(q, row_scale, x, RULE, int8, name="q").passed
    wide = judge_rounding(q.to(torch.int16), row_scale, x, RULE, int8, name="q")
    assert not wide.passed and "the codes are int16" in wide.reason


def test_a_scale_that_misses_a_declared_block_fails_by_shape() -> None:
    x, bits, scale = _fp8_case("nearest")
    result = judge_rounding(bits, scale[:, :2], x, RULE, GROUPS, name="q")
    assert not result.passed and result.rule == "shape"
    assert "expected (4, 3)" in result.reason and result.hint


def test_a_layout_that_depends_on_the_case_is_read_from_it() -> None:
    per_case = Output("q", kind="quantized", quantized_from="x", scale_from="scale",
                      layout=lambda case: CodeLayout("float8_e4m3fn", case["block"]))  # fmt: skip
    x, bits, scale = _fp8_case("nearest")
    case = Case("groups", {"block": (1, 128)})
    assert judge_rounding(bits, scale, x, RULE, per_case.layout_for(case), name="q").passed
    with pytest.raises(ValueError, match="depends on the case"):
        per_case.layout_for(None)
    with pytest.raises(ValueError, match="code format"):
        CodeLayout("float8_e4m3")


def test_ties_may_round_either_way_without_biasing() -> None:
    """Data full of exact ties (x / scale = k + 1/2, as in the kv_quant ties regime): ties
    to even and half away from zero both round to a nearest point, so neither is off by
    one nor biased."""
    x = (torch.arange(-254, 255, dtype=torch.float64) / 2)[None]  # halves up to 127
    scale = torch.ones(1, 1)
    away = torch.sign(x) * torch.floor(x.abs() + 0.5)
    for q in (torch.round(x), away):
        result = judge_rounding(q.to(torch.int8), scale, x, RULE, LAYOUT, name="q")
        assert result.passed, result.reason
        assert result.budget["off_by_one_share"] == result.budget["bias_steps"] == 0.0


def test_quantized_outputs_name_their_input_and_scale() -> None:
    with pytest.raises(ValueError, match="quantized_from"):
        Output("q", kind="quantized")


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "llama3"])
def test_scaled_inverse_frequencies_match_transformers(kind: str) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from operators.rope_scaling import ROPE_SCALINGS, THETAS, scaled_inv_freq

    rope = dict(ROPE_SCALINGS[kind])
    original = rope["original_max_position_embeddings"]
    if kind in ("linear", "dynamic"):  # transformers reads their context from the config
        del rope["original_max_position_embeddings"]
    config = LlamaConfig(
        hidden_size=512, num_attention_heads=4, head_dim=128, max_position_embeddings=original,
        rope_parameters=rope | {"rope_theta": THETAS[kind]},
    )  # fmt: skip
    seq_len = 3 * original  # beyond the original context
    theirs, their_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
    mine, my_factor = scaled_inv_freq(128, THETAS[kind], ROPE_SCALINGS[kind], seq_len)
    # transformers computes in float32: agreement to a few float32 roundings (eps 1.2e-7)
    assert torch.allclose(theirs.double(), mine, rtol=1e-6, atol=0)
    assert math.isclose(their_factor, my_factor, rel_tol=1e-12)


def test_sampling_draws_sit_mid_step_of_one_of_the_two_most_probable_tokens() -> None:
    load_catalogue()
    from operators.sampling import _kept_sorted

    op = OPERATORS["sampling"]
    for case in op.cases_for("pr"):
        inputs = make_inputs(op, case)
        if not inputs["logits"].shape[0] or inputs["logits"].shape[1] < 2:
            continue
        probs, _ = _kept_sorted(
            inputs["logits"], inputs["temperature"], inputs["top_k"], inputs["top_p"]
        )
        u = inputs["u"]
        first = probs[:, 0]
        mid_first = (u - first / 2).abs() < 1e-12
        mid_second = (u - first - probs[:, 1] / 2).abs() < 1e-12
        assert bool((mid_first | mid_second).all()), case.name


def test_new_aten_operators_map_to_catalogue_operators() -> None:
    load_catalogue()
    table = aten_to_operators()  # declared by the catalogue's operators (Operator.aten)
    for aten in ("_log_softmax", "nll_loss_forward", "multinomial", "tanh"):
        assert set(table[aten]) <= set(OPERATORS), aten
    assert "cross_entropy" in table["nll_loss_forward"]
    assert "logit_softcap" in table["tanh"]
    assert table["gelu"] == ("gelu_erf",) and table["gelu(approximate=tanh)"] == ("gelu_tanh",)


def test_gemma_offset_cases_use_a_zero_centered_weight() -> None:
    load_catalogue()
    for name in ("rms_norm", "add_rms_norm"):
        op = OPERATORS[name]
        with_offset = [c for c in op.cases_for("smoke") if c.get("offset")]
        assert with_offset, name
        inputs = make_inputs(op, with_offset[0])
        assert inputs["offset"] == 1.0
        assert float(inputs["weight"].mean().abs()) < 0.01  # zero-centered: 0.1 * N(0, 1)
