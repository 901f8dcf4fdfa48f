"""Tiny configs of any type: sizes shrunk generically, per-layer lists keep one layer of each
kind, token ids inside the vocabulary; every override-table entry is needed (the generic
shrink alone does not build) and sufficient (it builds and runs); a type transformers cannot
build is a BuildError with transformers' message."""

from __future__ import annotations

from pathlib import Path

import pytest

from numalign.sweep import shrink as shrink_module
from numalign.sweep.build import BuildError, build_tiny, causal_lm_types
from numalign.sweep.shrink import LAYERS, OVERRIDES, SIZES, shrink


def test_sizes_shrink_and_layer_lists_keep_one_layer_of_each_kind() -> None:
    defaults = {
        "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 8,
        "layer_types": ["linear", "linear", "linear", "full"] * 2,
        "mlp_bias": [True] * 8, "vocab_size": 150000, "eos_token_id": 149999,
        "head_dim": 8, "use_cache": True,
    }  # fmt: skip
    out = shrink(defaults)
    assert out["hidden_size"] == SIZES["hidden_size"]
    assert out["head_dim"] == 8  # a size already below the tiny one is kept
    assert out["num_hidden_layers"] == 2 and out["layer_types"] == ["linear", "full"]
    assert out["mlp_bias"] == [True, True]  # every per-layer list, the same layers
    assert out["eos_token_id"] == 1 < out["vocab_size"]  # bos 0, eos 1, pad 2
    assert "use_cache" not in out  # a boolean is never a size


def test_a_model_of_one_layer_kind_keeps_the_default_count_of_layers() -> None:
    assert shrink({"num_hidden_layers": 32})["num_hidden_layers"] == LAYERS


def test_latent_attention_keeps_a_key_value_head_per_head() -> None:
    out = shrink({"num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
                  "qk_rope_head_dim": 64, "head_dim": 64})  # fmt: skip
    assert out["num_key_value_heads"] == out["num_attention_heads"]
    assert out["head_dim"] == out["qk_rope_head_dim"]


@pytest.mark.parametrize("model_type", sorted(OVERRIDES))
def test_each_override_is_needed_and_builds(
    model_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert model_type in causal_lm_types()
    assert build_tiny(model_type, tmp_path).joinpath("config.json").is_file()  # and ran
    monkeypatch.setattr(shrink_module, "OVERRIDES", {})
    try:
        build_tiny(model_type, tmp_path / "generic")
    except BuildError:
        return  # needed: the generic shrink alone does not build
    import transformers

    # the table is written for the transformers CI's main job installs (5.24); an entry
    # another version does not need (recurrent_gemma on vLLM's pin, 5.19) is said, not failed
    if transformers.__version__.startswith("5.24"):
        pytest.fail(f"the override of {model_type} is not needed: the generic shrink builds it")
    pytest.skip(f"transformers {transformers.__version__} builds {model_type} without its "
                "override (written for 5.24)")  # fmt: skip


def test_a_type_transformers_cannot_build_is_listed_with_its_message(tmp_path: Path) -> None:
    # MusicGen's causal-LM class is built on the type's composite config, while it reads its
    # decoder's (config.dropout)
    with pytest.raises(BuildError, match="object has no attribute 'dropout'"):
        build_tiny("musicgen", tmp_path)
    assert not (tmp_path / "musicgen").exists()


def test_derived_sizes_left_none_get_the_tiny_size() -> None:
    # Ministral's default head_dim is None, which its attention reads as a number
    out = shrink({"head_dim": None, "num_key_value_heads": None, "sliding_window": None})
    assert out == {
        "head_dim": SIZES["head_dim"],
        "num_key_value_heads": 2,
    }  # a None window stays off


def test_layer_kinds_come_from_any_per_layer_list_of_names() -> None:
    # Zamba names its layers' kinds layers_block_type, not layer_types
    kinds = ["mamba"] * 5 + ["hybrid"]
    out = shrink({"num_hidden_layers": 6, "layers_block_type": kinds})
    assert out["layers_block_type"] == ["mamba", "hybrid"]


def test_settings_by_layer_index_follow_the_kept_layers() -> None:
    # Gemma 4's per_layer_config: keys are layer indices, re-indexed to the kept layers
    per_layer = {"02": {"head_dim": 512}, "05": {"head_dim": 512}}  # as Gemma 4 writes them
    kinds = ["s", "s", "f", "s", "s", "f"]
    out = shrink({"num_hidden_layers": 6, "layer_types": kinds, "per_layer_config": per_layer,
                  "head_dim": 256})  # fmt: skip
    assert out["layer_types"] == ["s", "f"]
    # scaled as the global head dim was (256 -> 16): still twice the others'
    assert out["per_layer_config"] == {1: {"head_dim": 2 * SIZES["head_dim"]}}
    # labels by index are no per-layer settings
    assert "id2label" not in shrink({"num_hidden_layers": 6, "id2label": {0: "A", 1: "B"}})


def test_an_image_text_type_builds_through_its_own_auto_class(tmp_path: Path) -> None:
    assert "llava" in causal_lm_types(image_text=True)
    assert "llava" not in causal_lm_types()
    assert (build_tiny("llava", tmp_path) / "config.json").is_file()  # built and ran on text


def test_expert_counts_left_none_in_a_mixture_of_experts_get_the_tiny_size() -> None:
    # DeepSeek-V2's num_experts_per_tok and dots1's n_routed_experts default to None, which
    # their routers read as numbers; a config without expert MLPs keeps its None
    moe = shrink({"moe_intermediate_size": 1408, "n_routed_experts": None,
                  "num_experts_per_tok": None, "n_shared_experts": None})  # fmt: skip
    assert moe["n_routed_experts"] == SIZES["n_routed_experts"]
    assert moe["num_experts_per_tok"] == SIZES["num_experts_per_tok"]
    assert moe["n_shared_experts"] == SIZES["n_shared_experts"]
    assert "num_experts_per_tok" not in shrink({"num_experts_per_tok": None})


def test_a_width_under_another_name_follows_the_width() -> None:
    # xLSTM's embedding_dim is its hidden size; a length equal to it by chance is not
    out = shrink({"hidden_size": 1024, "embedding_dim": 1024, "max_seq_len": 1024,
                  "lru_width": 1024, "index_topk": 1024, "image_size": 1024})  # fmt: skip
    assert out["embedding_dim"] == out["lru_width"] == out["hidden_size"] == SIZES["hidden_size"]
    assert not {"max_seq_len", "index_topk", "image_size"} & set(out)


def test_a_nested_config_width_follows_its_parents_and_its_siblings() -> None:
    # dots3's vision adapter maps its own width in and the text width out
    out = shrink({
        "text_config": {"model_type": "t", "hidden_size": 5120},
        "vision_config": {"model_type": "v", "hidden_size": 1536, "adapter_in_dim": 1536,
                          "adapter_out_dim": 5120},
    })  # fmt: skip
    vision = out["vision_config"]
    assert vision["adapter_in_dim"] == vision["adapter_out_dim"] == SIZES["hidden_size"]


def test_num_blocks_is_a_layer_count() -> None:
    out = shrink({"num_hidden_layers": 32, "num_blocks": 32})  # xLSTM's
    assert out["num_blocks"] == out["num_hidden_layers"] == LAYERS


def test_a_size_given_per_layer_is_shrunk_for_each_kept_layer() -> None:
    # Gemma 3n's intermediate_size is a list, one per layer
    out = shrink({"num_hidden_layers": 4, "intermediate_size": [16384] * 4})
    assert out["intermediate_size"] == [SIZES["intermediate_size"]] * LAYERS


def test_a_part_of_the_vocabulary_stays_inside_it() -> None:
    # inkling2 pads its embedding from unpadded_vocab_size to vocab_size
    out = shrink({"vocab_size": 201024, "unpadded_vocab_size": 200058,
                  "ngram_vocab_size": 20000000, "audio_vocab_size": 2048})  # fmt: skip
    assert out["unpadded_vocab_size"] == out["vocab_size"]
    # vocabularies of their own (Moshi's audio codebook), not parts of it
    assert "ngram_vocab_size" not in out and "audio_vocab_size" not in out


def test_layers_that_reuse_earlier_caches_keep_a_producer_of_each_kind() -> None:
    # Gemma 3n: the last num_kv_shared_layers reuse the last earlier cache of their kind
    kinds = ["sliding_attention"] * 4 + ["full_attention"]
    out = shrink({"num_hidden_layers": 35, "layer_types": kinds * 7, "num_kv_shared_layers": 15})
    assert out["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert out["num_hidden_layers"] == 4 and out["num_kv_shared_layers"] == 2


def test_latent_attention_keeps_the_sums_of_its_head_parts() -> None:
    # bailing_hybrid's qk_head_dim is its no-rope part plus its rope part
    out = shrink({"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                  "qk_head_dim": 192, "head_dim": 64})  # fmt: skip
    assert out["qk_head_dim"] == out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    assert out["head_dim"] == out["qk_rope_head_dim"]
    # dots3's head_dim is its sliding layers' no-rope part plus the rope part
    per_layer = {"01": {"qk_nope_head_dim": 192}}
    out = shrink({"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                  "head_dim": 256, "num_hidden_layers": 2,
                  "per_layer_config": per_layer})  # fmt: skip
    layer = out["per_layer_config"][1]
    assert out["head_dim"] == layer["qk_nope_head_dim"] + out["qk_rope_head_dim"]


def test_an_override_of_a_nested_config_keeps_its_shrunk_keys() -> None:
    # dbrx's entry adds rope_theta to attn_config; ffn_config's shrunk sizes stay
    out = shrink({"d_model": 2048, "n_layers": 24,
                  "attn_config": {"model_type": "", "kv_n_heads": 1},
                  "ffn_config": {"model_type": "", "ffn_hidden_size": 3584}}, "dbrx")  # fmt: skip
    assert out["attn_config"]["rope_theta"] and out["attn_config"]["kv_n_heads"] == 1
    assert out["ffn_config"]["ffn_hidden_size"] == SIZES["ffn_hidden_size"]


@pytest.mark.parametrize(
    "model_type",
    [
        "deepseek_v2",  # expert counts left None
        "dots1",  # expert counts left None
        "bailing_hybrid",  # num_expert_group, qk_head_dim
        "inkling2_text",  # unpadded_vocab_size
        "gemma3n_text",  # per-layer intermediate_size, num_kv_shared_layers
        "dots3_note_text",  # sliding layers' head_dim = no-rope + rope part
        "dots3_note",  # and its vision and audio adapters' widths
    ],
)
def test_a_type_the_generic_rules_fixed_builds_and_runs(model_type: str, tmp_path: Path) -> None:
    assert model_type in causal_lm_types()
    assert build_tiny(model_type, tmp_path).joinpath("config.json").is_file()  # and ran


def test_mrope_sections_follow_the_tiny_head_named_or_from_the_models_code() -> None:
    # Qwen2-VL's config names no sections: its rotary embedding falls back to [16, 24, 24],
    # the rotary half of a head of 128; a tiny head of 16 rotates 8 frequencies
    qwen2_vl = {"model_type": "qwen2_vl_text", "hidden_size": 8192, "num_attention_heads": 64,
                "head_dim": None, "rope_parameters": {"rope_type": "default"}}  # fmt: skip
    assert shrink(qwen2_vl)["rope_parameters"]["mrope_section"] == [2, 3, 3]
    # named, with a partial rotary factor of one half (GLM-4V-MoE): a quarter of the head
    rope = {"partial_rotary_factor": 0.5, "mrope_section": [8, 12, 12]}
    glm = {"model_type": "glm4v_moe_text", "hidden_size": 4096, "num_attention_heads": 32,
           "rope_parameters": rope}  # fmt: skip
    assert sum(shrink(glm)["rope_parameters"]["mrope_section"]) == SIZES["head_dim"] // 4
    # a latent head's rotary part is its own size (HY-V4-VL: qk_rope_head_dim)
    latent = {"model_type": "hy_v4_vl_text", "kv_lora_rank": 512, "num_attention_heads": 64,
              "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "head_dim": 64,
              "rope_parameters": {"mrope_section": [12, 10, 10]}}  # fmt: skip
    out = shrink(latent)
    assert sum(out["rope_parameters"]["mrope_section"]) == out["qk_rope_head_dim"] // 2


def test_special_token_ids_past_the_vocabulary_move_inside_it() -> None:
    # Qwen3-VL's image token 151655 indexed past a vocabulary of 512, and its capture's image
    # request crashed the embedding; each special token gets an id of its own at the top
    composite = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id":
                 151652, "vision_end_token_id": 151653, "text_config": {"model_type":
                 "qwen3_vl_text", "vocab_size": 151936}}  # fmt: skip
    out = shrink(composite)
    vocab = out["text_config"]["vocab_size"]
    ids = [out[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                            "video_token_id")]  # fmt: skip
    assert ids == [vocab - 1, vocab - 2, vocab - 3, vocab - 4]


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl", "glm4v", "hy_v4_vl"])
def test_an_mrope_image_text_type_builds_and_runs(model_type: str, tmp_path: Path) -> None:
    assert model_type in causal_lm_types(image_text=True)
    assert build_tiny(model_type, tmp_path).joinpath("config.json").is_file()  # and ran


def test_the_image_request_is_cut_in_the_models_own_patches(tmp_path: Path) -> None:
    """Qwen3-VL's vision tower takes patches of 16 pixels, Qwen2-VL's of 14: the image request
    was cut for 14 alone, and Qwen3-VL's capture crashed on the patches' size."""
    from numalign.golden.requests import image_request
    from numalign.sweep.build import tiny_config

    config = tiny_config("qwen3_vl")
    request = image_request(tmp_path, config, None)
    assert request is not None
    vision = config.vision_config
    patch = 3 * vision.temporal_patch_size * vision.patch_size**2  # channels x time x 16 x 16
    assert request.inputs["pixel_values"].shape[-1] == patch == 1536
    # the image tokens are the patches after the 2 x 2 merge, inside the tiny vocabulary
    grid = request.inputs["image_grid_thw"]
    tokens = int(grid.prod()) // vision.spatial_merge_size**2
    ids = request.inputs["input_ids"]
    assert int((ids == config.image_token_id).sum()) == tokens
    assert int(ids.max()) < config.text_config.vocab_size


def test_a_vision_towers_output_is_the_text_width() -> None:
    # Qwen3-VL's defaults disagree (out_hidden_size 3584 beside a text width of 4096), so no
    # width rule maps it, and its capture's image request failed ("Image features and image
    # tokens do not match"): a projection that feeds the text model takes its tiny width
    composite = {
        "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 4096},
        "vision_config": {"model_type": "qwen3_vl", "hidden_size": 1152, "out_hidden_size": 3584},
    }
    out = shrink(composite)
    assert out["vision_config"]["out_hidden_size"] == out["text_config"]["hidden_size"] == 64
