"""Tiny configs of any transformers model type: the type's own config class with its sizes
shrunk generically (layers, hidden, heads, experts, windows, state sizes, MLA ranks, per-layer
lists), plus ``OVERRIDES``, a small table for the types whose config cannot be shrunk
generically (each entry with its reason).

Only keys the type's default config has are set, so a size a type does not know is never
invented. Per-layer lists (``layer_types`` and every other list as long as the default's
layer count) keep one layer of each distinct kind in the default's order (at least
``LAYERS``), so a hybrid model keeps its attention and its mixer layers.

Keys that depend on the shrunk sizes follow them: a width under another name (an embedding's
or an adapter's, of the config or of the config it is nested in or beside), a vision tower's
output width (the text model's), a part of the vocabulary, special token ids (moved inside
it), latent attention's head sums, M-RoPE sections (the rotary half of the tiny head), a
mixture of experts' counts left None, a size given per layer, and the layers that reuse an
earlier layer's cache (kept with a producer of each kind).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from typing import Any, TypeGuard

#: The layers a shrunk model keeps when its layers are all of one kind.
LAYERS = 2
#: At most this many layers: one of each kind, in the default's order.
MAX_LAYERS = 4

#: Sizes set where the type's default config has the key (the zoo's tiny sizes: hidden 64,
#: 4 heads of 16, 2 key-value heads; small enough that a type builds and runs in seconds).
SIZES: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "intermediate_size": 128,
    "ffn_hidden_size": 128,
    "intermediate_size_mlp": 128,
    "n_inner": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_attention_heads": 4,
    "n_head": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 8,
    "max_position_embeddings": 256,
    "n_positions": 256,
    # experts: 4, two per token, one shared
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_k": 2,
    "moe_num_shared_experts": 1,
    "num_shared_experts": 1,
    "top_k_experts": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "n_group": 2,
    "num_expert_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    # windows and chunks shorter than the prompts, so that they are exercised
    "sliding_window": 8,
    "attention_chunk_size": 8,
    "chunk_size": 8,
    "block_size": 8,
    # multi-head latent attention ranks
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # linear attention, gated delta rule, state-space mixers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "state_size": 16,
    "num_heads": 4,
    "n_groups": 1,
    "time_step_rank": 8,
    "mamba_d_ssm": 64,
    # heads x head dim = expand (2) x hidden (64), as Mamba-2 mixers require
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_chunk_size": 8,
    "mamba_n_groups": 1,
    "ssm_state_size": 16,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 512,
}
#: Keys whose None default means "derived" (head_dim from hidden / heads; key-value heads
#: as many as heads) and which the type's own code reads as a number: set to the tiny size.
DERIVED = ("head_dim", "num_key_value_heads")
#: Expert counts whose None default in a mixture-of-experts config (one with a
#: ``moe_intermediate_size``) means "set by the checkpoint" and which its code reads as a
#: number (DeepSeek-V2's ``num_experts_per_tok``, dots1's ``n_routed_experts``): the tiny size.
EXPERT_KEYS = tuple(
    k for k in SIZES if "expert" in k or k in ("moe_k", "moe_topk")
)  # fmt: skip
#: Keys holding a layer count.
LAYER_KEYS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "decoder_layers",
    "num_blocks",
)
#: Keys of the hidden size's own name (a config's width) ...
WIDTH_KEYS = ("hidden_size", "d_model", "n_embd")
#: ... and the endings of the keys that, where their default equals a width of the config (or
#: of the config it is nested in), are that width under another name and must stay equal to it
#: (xLSTM's ``embedding_dim``, an adapter's ``adapter_in_dim``, RWKV's
#: ``attention_hidden_size``): they follow it. Not every ``_size``: an image's is no width.
WIDTH_ENDINGS = ("_dim", "_width", "hidden_size", "embedding_size", "input_size")
#: A vocabulary size this close to the vocabulary's (and no larger) is a part or a copy of it
#: (inkling2's ``unpadded_vocab_size``, Marian's ``decoder_vocab_size``), not a vocabulary of
#: its own (Moshi's audio codebook): it is shrunk with it.
VOCAB_PART = 0.9
#: Token ids beyond the shrunk vocabulary are moved inside it.
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
#: The endings of the other special tokens' keys (an image's, a video's, a vision span's
#: start and end): an id past the tiny vocabulary is moved to its top, one id each. (The
#: capture's seeded text rows may hold such an id, as any other: without an image, the
#: models swept embed it as text.)
SPECIAL_TOKEN_ENDINGS = ("_token_id", "_token_index")
#: The M-RoPE sections a model's code falls back to where its config names none
#: (``rope_parameters.get("mrope_section", [16, 24, 24])`` in Qwen2-VL's rotary embedding).
_MROPE_FALLBACK = re.compile(r"""["']mrope_section["']\s*,\s*(\[[\d,\s]+\])""")

#: Qwen4-Exp's token indexer (QSA): one key head, a budget of 2 blocks of 2 tokens.
_QSA = {
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 4,
    "indexer_compress_ratio": 2,
}

#: Types whose config the generic shrink cannot make valid: key -> value set after it (a
#: nested config's dict sets its own keys, its shrunk others kept), with the reason: a
#: type-specific constraint, or a key its code reads that its default config lacks and its
#: checkpoints carry. Each entry is tested (``tests/sweep/test_shrink.py``) to be needed and
#: to build.
OVERRIDES: dict[str, tuple[dict[str, Any], str]] = {
    "mamba2": (
        {"num_heads": 8},
        "its heads x head dim must equal expand (2) x hidden",
    ),
    "jamba": (
        {
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
        },
        "its attention layers are every 8th from layer 4 (attn_layer_period, _offset): two "
        "layers would hold none",
    ),
    "bamba": (
        {"attn_layer_indices": [1]},
        "its default has no attention layer (attn_layer_indices None), with which its cache "
        "cannot tell the sequence length",
    ),
    "recurrent_gemma": (
        {"block_types": ["recurrent", "attention"]},
        "its block types cycle a pattern of 3 (recurrent, recurrent, attention): two layers "
        "would hold no attention",
    ),
    "granitemoehybrid": (
        {"layer_types": ["linear_attention", "full_attention"]},
        "its default has only Mamba layers (layer_types all linear_attention), with which its "
        "cache cannot tell the sequence length",
    ),
    "zamba": (
        {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
        "its hybrid layers share one transformer block, tied from the first to the others: one "
        "hybrid layer leaves the tie nothing to tie to",
    ),
    "dory": (
        {
            "num_hidden_layers": 6,
            "layer_types": [
                *("sliding_attention", "mlp"),
                *("full_attention", "mlp"),
                *("sliding_attention", "mlp"),
            ],
            "n_input_layers": 2,
            "n_recurrent_layers": 2,
            "n_output_layers": 2,
        },
        "its layers are (attention, mlp) pairs (to_dict doubles the counts), split into input, "
        "recurrent and output layers whose counts must add up to the layers",
    ),
    "xlstm": (
        {"hidden_size": 128, "embedding_dim": 128},
        "its cache rounds the query-key width (hidden x qk_dim_factor 0.5) up to a multiple of "
        "64 and its layers do not: hidden 64 gives them 32 against the cache's 64",
    ),
    "dbrx": (
        {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
        "its attention reads attn_config.rope_theta, which DbrxAttentionConfig does not define, "
        "and clamps to clip_qkv, whose None default torch.clamp refuses (its checkpoints' "
        "configs carry both)",
    ),
    "cohere_compass_text": (
        {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
        "its default rope_parameters are empty and its rotary embedding reads one per layer "
        "type (its checkpoints' configs carry them)",
    ),
    "lfm2_moe": (
        {"layer_types": ["conv", "full_attention"]},
        "its default layer_types is None, which its layers index (LFM2's config derives them "
        "from full_attn_idxs; LFM2-MoE's does not)",
    ),
    "qwen4_exp_text": (
        _QSA,
        "its default layer_types hold indexed_attention layers but its indexer's sizes "
        "(indexer_*) default to None (its checkpoints' configs set them)",
    ),
    "qwen4_exp": ({"text_config": _QSA}, "its text config: as qwen4_exp_text"),
    "reformer": (
        {"axial_pos_embds_dim": [16, 48], "axial_pos_shape": [16, 16]},
        "its axial position embeddings split the hidden size into parts (axial_pos_embds_dim "
        "must sum to it) over a grid of the positions (axial_pos_shape multiplies to "
        "max_position_embeddings)",
    ),
    "xmod": (
        {"default_language": "en_XX"},
        "its forward needs a language for its adapters: without default_language it raises "
        "'Input language unknown'",
    ),
}


def _int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _layer_indices(defaults: dict[str, Any], count: int) -> list[int]:
    """The default's layers kept: the first of each distinct kind (``layer_types``, else the
    first per-layer list of names, Zamba's ``layers_block_type``; at least ``LAYERS``, at
    most ``MAX_LAYERS``), in order."""
    per_layer = [
        v for v in defaults.values()
        if isinstance(v, list) and len(v) == count and all(isinstance(k, str) for k in v)
    ]  # fmt: skip
    kinds = defaults.get("layer_types") or (per_layer[0] if per_layer else None)
    keep: list[int] = []
    if isinstance(kinds, list) and len(kinds) == count:
        seen: set[Any] = set()
        for i, kind in enumerate(kinds):
            if kind not in seen:
                seen.add(kind)
                keep.append(i)
    keep = keep[:MAX_LAYERS]
    for i in range(count):
        if len(keep) >= LAYERS:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def _scaled(layer: dict[str, Any], defaults: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """One layer's own sizes scaled as the global ones were (Gemma 4's global layers' head
    dim 512 against 256 elsewhere: 32 against the tiny 16), so they still differ."""
    scaled = dict(layer)
    for key, value in layer.items():
        old, new = defaults.get(key), out.get(key)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (value, old, new)):
            scaled[key] = max(1, round(value * new / old)) if old else value
    nope, rope = layer.get("qk_nope_head_dim"), defaults.get("qk_rope_head_dim")
    if _int(nope) and _int(rope) and defaults.get("head_dim") == nope + rope and "head_dim" in out:
        # the layer's head is its no-rope part and the rope part (dots3's sliding layers)
        scaled["qk_nope_head_dim"] = out["head_dim"] - out.get("qk_rope_head_dim", rope)
    return scaled


def _part(value: int, defaults: dict[str, Any]) -> bool:
    """Whether a vocabulary size is a part or a copy of the vocabulary (``VOCAB_PART``)."""
    vocab: int = defaults["vocab_size"]
    return VOCAB_PART * vocab <= value <= vocab


def _latent(defaults: dict[str, Any], out: dict[str, Any]) -> None:
    """Multi-head latent attention's sizes that depend on each other, as the default has them."""
    if "num_key_value_heads" in out:
        # latent attention expands its one compressed key-value to every head
        out["num_key_value_heads"] = out.get("num_attention_heads", SIZES["num_attention_heads"])
    nope, rope = defaults.get("qk_nope_head_dim"), defaults.get("qk_rope_head_dim")
    if "head_dim" in out and "qk_rope_head_dim" in out and defaults.get("head_dim") in (None, rope):
        out["head_dim"] = out["qk_rope_head_dim"]  # its rotary tables span the rope part only
    parts = "qk_nope_head_dim" in out and "qk_rope_head_dim" in out
    if parts and _int(nope) and _int(rope) and defaults.get("qk_head_dim") == nope + rope:
        # the query-key head: its no-rope part and its rope part (bailing_hybrid's qk_head_dim)
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]


def _head_dim(config: dict[str, Any]) -> int | None:
    head, hidden, heads = (
        config.get(k) for k in ("head_dim", "hidden_size", "num_attention_heads")
    )
    if _int(head):
        return head
    return hidden // heads if _int(hidden) and _int(heads) and heads else None


def _mrope_sections(defaults: dict[str, Any], out: dict[str, Any]) -> None:
    """M-RoPE's sections (temporal, height, width frequencies) sum to the rotary half of the
    tiny head (its head dim times the partial rotary factor, or a latent head's rotary part,
    over 2): scaled to it proportionally (Qwen2-VL's [16, 24, 24] become [2, 3, 3] of a head
    of 16), whether the config names them or the model's code falls back to them."""
    rope = defaults.get("rope_parameters")
    if (
        not isinstance(rope, dict)
        or not rope
        or any(isinstance(v, dict) for v in rope.values())  # one per layer type: not M-RoPE's
        or not isinstance(defaults.get("model_type"), str)
    ):
        return
    sections = rope.get("mrope_section") or _code_mrope_sections(defaults["model_type"])
    tiny = {**defaults, **out}
    # a latent head's rotary part is its own size (HY-V4's qk_rope_head_dim); another head
    # rotates the share its partial rotary factor names
    rotary = tiny.get("qk_rope_head_dim")
    if not _int(rotary):
        head = _head_dim(tiny)
        factor = rope.get("partial_rotary_factor", defaults.get("partial_rotary_factor")) or 1.0
        rotary = int(head * factor) if head else None
    if not sections or not rotary:
        return
    total = max(len(sections), rotary // 2)
    if total == sum(sections):
        return
    shares = [s * total / sum(sections) for s in sections]
    scaled = [max(1, int(x)) for x in shares]
    # largest remainders first, until the sections sum to the total again
    for i in sorted(range(len(shares)), key=lambda i: int(shares[i]) - shares[i]):
        if sum(scaled) >= total:
            break
        scaled[i] += 1
    out["rope_parameters"] = {**rope, **out.get("rope_parameters", {}), "mrope_section": scaled}


def _code_mrope_sections(model_type: str) -> list[int] | None:
    """The M-RoPE sections the modeling code of ``model_type`` falls back to, if any."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        module = CONFIG_MAPPING[model_type].__module__.replace(".configuration_", ".modeling_")
        found = _MROPE_FALLBACK.search(inspect.getsource(importlib.import_module(module)))
    except Exception:  # a type without modeling code of that shape has no fallback
        return None
    return [int(x) for x in json.loads(found.group(1))] if found else None


def _special_tokens(defaults: dict[str, Any], out: dict[str, Any], vocab: Any) -> None:
    """Special token ids (not bos, eos, pad) past the tiny vocabulary (Qwen3-VL's image token
    151655 of 512), each moved to an id of its own at the vocabulary's top, in the order of
    their defaults."""
    if not _int(vocab):
        return
    keys = [k for k, v in defaults.items() if _int(v) and v >= vocab and k not in TOKEN_KEYS
            and k.endswith(SPECIAL_TOKEN_ENDINGS)]  # fmt: skip
    keys.sort(key=lambda k: defaults[k])
    for i, key in enumerate(keys):
        out[key] = vocab - 1 - i


def _layers(defaults: dict[str, Any], out: dict[str, Any], count: int) -> None:
    """The default's ``count`` layers shrunk to those ``_layer_indices`` keeps: the layer
    counts, every per-layer list (as shrunk in ``out`` already, else the default's) and
    per-layer settings by index (their sizes ``_scaled``), and the layers that reuse an
    earlier layer's cache (kept with a producer of each kind)."""
    keep = _layer_indices(defaults, count)
    shared = defaults.get("num_kv_shared_layers")
    if _int(shared) and 0 < shared < count:
        # the last layers reuse the cache of the last earlier layer of their kind (Gemma 3n):
        # the kept layers twice, the second time sharing, so that each kind produces a cache
        # and uses one
        out["num_kv_shared_layers"] = len(keep)
        keep = keep + keep
    for key in LAYER_KEYS:
        if key in defaults:
            out[key] = len(keep)
    for key, value in defaults.items():
        if isinstance(value, list) and len(value) == count and count > len(keep):
            out[key] = [out.get(key, value)[i] for i in keep]
        elif (
            isinstance(value, dict)
            and value
            and all(str(k).isdigit() and isinstance(v, dict) for k, v in value.items())
        ):
            # per-layer settings by layer index (Gemma 4's per_layer_config): the kept
            # layers' own, under their new indices
            by_index = {int(k): v for k, v in value.items()}
            out[key] = {
                new: _scaled(by_index[i], defaults, out)
                for new, i in enumerate(keep)
                if i in by_index
            }


def _token_ids(defaults: dict[str, Any], out: dict[str, Any], vocab: Any) -> None:
    """The bos, eos and pad ids (``TOKEN_KEYS``) inside the tiny vocabulary ``vocab``: an id
    past it becomes its key's index in ``TOKEN_KEYS``, an id of a list past it 2."""
    for key in TOKEN_KEYS:
        token = defaults.get(key)
        if isinstance(vocab, int) and isinstance(token, int) and token >= vocab:
            out[key] = TOKEN_KEYS.index(key)
        elif isinstance(token, list):
            out[key] = [t if t < (vocab or t + 1) else 2 for t in token]


def shrink(
    defaults: dict[str, Any],
    model_type: str | None = None,
    widths: dict[int, int] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of a tiny config from a type's default config (``to_dict()``):
    sizes from ``SIZES``, layers and per-layer lists shrunk, token ids inside the vocabulary,
    then the type's ``OVERRIDES`` entry. Nested configs are shrunk the same way, with the
    widths of the config they are nested in (``widths``: default -> tiny)."""
    out: dict[str, Any] = {}
    count = next((defaults[k] for k in LAYER_KEYS if isinstance(defaults.get(k), int)), None)
    moe = _int(defaults.get("moe_intermediate_size"))
    for key, value in defaults.items():
        if key in SIZES and _int(value) and value:
            out[key] = min(value, SIZES[key])
        elif key in SIZES and isinstance(value, list) and value and all(map(_int, value)):
            # a size given per layer (Gemma 3n's intermediate_size): each layer's shrunk
            out[key] = [min(v, SIZES[key]) for v in value]
        elif value is None and (key in DERIVED or (moe and key in EXPERT_KEYS)):
            out[key] = SIZES[key]
    nested = {
        k: v for k, v in defaults.items()
        if k.endswith("_config") and isinstance(v, dict) and "model_type" in v
    }  # fmt: skip
    # this config's widths, and its nested configs' (a vision adapter's output is the text width)
    widths = {**(widths or {})}
    for config in (*nested.values(), defaults):
        for k in WIDTH_KEYS:
            if _int(config.get(k)) and k in SIZES and config[k] > SIZES[k]:
                widths[config[k]] = SIZES[k]
    vocab = out.get("vocab_size", defaults.get("vocab_size"))
    for key, value in defaults.items():
        if key in out or not _int(value):
            continue
        if value in widths and key.endswith(WIDTH_ENDINGS) and not key.startswith("max_"):
            out[key] = widths[value]  # the width under another name
        elif (
            key.endswith("vocab_size") and _int(vocab) and vocab < value and _part(value, defaults)
        ):
            out[key] = vocab  # a part of the vocabulary
    for key, value in nested.items():
        out[key] = {**value, **shrink(value, widths=widths)}
    if defaults.get("kv_lora_rank"):
        _latent(defaults, out)
    if count:
        _layers(defaults, out, count)
    _token_ids(defaults, out, vocab)
    # a vision tower's projection feeds the text model: its output is the text width, which a
    # type's defaults may not agree with (Qwen3-VL's out_hidden_size 3584 beside 4096)
    text = out.get("text_config")
    if isinstance(text, dict) and _int(text.get("hidden_size")):
        for config in out.values():
            if isinstance(config, dict) and _int(config.get("out_hidden_size")):
                config["out_hidden_size"] = text["hidden_size"]
    # a composite config's special tokens index its text model's vocabulary
    text_vocab = next((c.get("vocab_size") for c in (out.get("text_config"), out) if
                       isinstance(c, dict) and _int(c.get("vocab_size"))), vocab)  # fmt: skip
    _special_tokens(defaults, out, text_vocab)
    _mrope_sections(defaults, out)
    for key, value in OVERRIDES.get(model_type or "", ({}, ""))[0].items():
        # a nested config's entry sets its keys, the shrunk others kept
        merge = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = {**out[key], **value} if merge else value
    return out
