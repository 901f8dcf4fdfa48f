"""The mapping of vLLM's modules onto capture points, and the rule that reads the reference's
output out of vLLM's dual residual stream: pure logic, checked without vLLM."""

from __future__ import annotations

import pytest
import torch

from numalign.replay.engines.vllm_points import (
    LM_HEAD,
    RENAMES,
    map_points,
    reference_output,
    residual_output,
)

# vLLM's LlamaForCausalLM as named_modules lists it (names -> classes), two layers
LLAMA = {
    "model.embed_tokens": "VocabParallelEmbedding",
    **{
        f"model.layers.{i}{part}": cls
        for i in range(2)
        for part, cls in [
            ("", "LlamaDecoderLayer"),
            (".self_attn", "LlamaAttention"),
            (".self_attn.qkv_proj", "QKVParallelLinear"),
            (".self_attn.o_proj", "RowParallelLinear"),
            (".mlp", "LlamaMLP"),
            (".mlp.gate_up_proj", "MergedColumnParallelLinear"),
            (".mlp.down_proj", "RowParallelLinear"),
            (".input_layernorm", "RMSNorm"),
            (".post_attention_layernorm", "RMSNorm"),
        ]
    },
    "model.norm": "RMSNorm",
    "lm_head": "ParallelLMHead",
}


class Config:
    final_logit_softcapping = None


def test_blocks_map_by_name_and_the_fused_projections_are_reported() -> None:
    points = ["model.embed_tokens", "model.layers.0", "model.layers.0.self_attn",
              "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj",
              "model.layers.1.input_layernorm", "model.norm"]  # fmt: skip
    mapped = {m.point: m for m in map_points("LlamaForCausalLM", points, LLAMA, Config())}
    for point in ["model.embed_tokens", "model.layers.0", "model.layers.0.self_attn",
                  "model.layers.1.input_layernorm", "model.norm"]:  # fmt: skip
        assert mapped[point].module == point
    for point in ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj"]:
        assert mapped[point].module is None
        # the reason names what vLLM has instead (the fused projection)
        assert "qkv_proj" in (mapped[point].reason or "") or "gate_up_proj" in (
            mapped[point].reason or ""
        )


def test_a_fused_activation_is_not_the_activation_alone() -> None:
    # vLLM's SiluAndMul multiplies the activation of one half of its input by the other: the
    # activation probe's point (the reference's act_fn alone) has no module there
    modules = {**LLAMA, "model.layers.0.mlp.act_fn": "SiluAndMul"}
    (mapped,) = map_points("LlamaForCausalLM", ["model.layers.0.mlp.act_fn"], modules, Config())
    assert mapped.module is None and "SiluAndMul" in (mapped.reason or "")


def test_a_mask_the_reference_builds_has_no_vllm_counterpart() -> None:
    # vLLM's attention reads sequence lengths from its metadata: no module builds a mask
    points = ["model.create_causal_mask", "model.create_sliding_window_causal_mask"]
    for mapped in map_points("LlamaForCausalLM", points, LLAMA, Config()):
        assert mapped.module is None and "builds no mask" in (mapped.reason or ""), mapped
    # nor the logit transform alone: vLLM's logits processor applies it with the head
    (mapped,) = map_points("Gemma2ForCausalLM", ["logit_transform"], LLAMA, Config())
    assert mapped.module is None and "logits processor" in (mapped.reason or "")


def test_renamed_blocks_follow_the_table() -> None:
    modules = {"model.layers.0.block_sparse_moe": "MixtralMoE", "model.layers.0": "X"}
    assert RENAMES["MixtralForCausalLM"]["mlp"] == "block_sparse_moe"
    (mapped,) = map_points("MixtralForCausalLM", ["model.layers.0.mlp"], modules)
    assert mapped.module == "model.layers.0.block_sparse_moe"
    # the same point of another architecture is not renamed
    (other,) = map_points("LlamaForCausalLM", ["model.layers.0.mlp"], modules)
    assert other.module is None


def test_lm_head_is_the_engines_logits_unless_capped_after_it() -> None:
    (plain,) = map_points("LlamaForCausalLM", ["lm_head"], LLAMA, Config())
    assert plain.module == LM_HEAD
    capped = Config()
    capped.final_logit_softcapping = 30.0
    (soft,) = map_points("Gemma2ForCausalLM", ["lm_head"], LLAMA, capped)
    assert soft.module is None and "soft-capping" in (soft.reason or "")


class RMSNorm(torch.nn.Module):
    pass


class LlamaDecoderLayer(torch.nn.Module):
    pass


def test_dual_residual_stream() -> None:
    hidden, residual = torch.randn(5, 8), torch.randn(5, 8)
    # a decoder layer's (hidden, residual): the reference's layer output is their sum
    assert torch.equal(reference_output(LlamaDecoderLayer(), (hidden, residual)), hidden + residual)
    # a fused add + norm's (normed, residual): the normed part, and the stream beside it
    assert reference_output(RMSNorm(), (hidden, residual)) is hidden
    assert residual_output(RMSNorm(), (hidden, residual)) is residual
    # a plain tensor is itself; a norm without a residual has no stream output
    assert reference_output(RMSNorm(), hidden) is hidden
    assert residual_output(RMSNorm(), hidden) is None
    assert residual_output(LlamaDecoderLayer(), (hidden, residual)) is None


@pytest.mark.parametrize("shapes", [[(5, 8), (5, 4)], [(5, 8), (5, 8), (5, 8)]])
def test_other_tuples_give_their_first_tensor(shapes: list[tuple[int, int]]) -> None:
    outputs = tuple(torch.randn(s) for s in shapes)
    assert reference_output(LlamaDecoderLayer(), outputs) is outputs[0]


def test_a_router_is_reported_unmapped_with_the_reason() -> None:
    # vLLM's Qwen3-MoE has a module of the router's name (a linear giving the logits), but its
    # fused MoE kernel chooses and weighs the experts: the routing has no counterpart
    modules = {**LLAMA, "model.layers.0.mlp.gate": "ReplicatedLinear"}
    point = "model.layers.0.mlp.gate"
    (mapped,) = map_points("Qwen3MoeForCausalLM", [point], modules, Config(), {point})
    assert mapped.module is None and "fused MoE kernel" in (mapped.reason or "")
    # a module of that name that is no router (its outputs hold no routing) maps by name
    (plain,) = map_points("Qwen3MoeForCausalLM", [point], modules, Config())
    assert plain.module == point
