"""The embedded tiny model zoo: small checkpoints of every family numalign must handle,
regenerated deterministically from the configs below with ``numalign zoo build``.

Random 0.02 initialisation gives logits below 1 and hidden states without outliers, which
would teach the wrong tolerances. The weights are therefore rescaled to the magnitudes of
real checkpoints: projections keep activations of order one (std 1/sqrt(fan_in)), a few
hidden channels of the embedding are 20x larger (the outlier channels real models carry
through the residual stream), and the LM head gives logits with a standard deviation of
about 4, so that they span tens. Gemma 2's attention logits are ten times larger than the
others' (``score_gain``), spanning tens, where its cap of 50 engages. Gemma 2 and GPT-2 tie
their LM head to the embedding; here they do not, so that the embedding's outlier channels do
not saturate the logits.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numalign.golden.requests import LONG_MARGIN, SERVING_BLOCK

#: Outlier channels: every 17th hidden channel of the embedding table, 20x larger.
OUTLIER_STRIDE, OUTLIER_SCALE = 17, 20.0
#: Embedding std and LM-head scale (std = LM_HEAD_GAIN / sqrt(hidden)).
EMBED_STD, LM_HEAD_GAIN = 0.5, 4.0
#: A router's score-correction bias (DeepSeek-V3's auxiliary-loss-free load balancing, added
#: to the expert scores to choose experts, not to weigh them): transformers initialises it at
#: zero, which a trained router's is not; drawn with this std (a few percent of a sigmoid
#: score), so a port that weighs the experts by the corrected scores errs.
ROUTER_BIAS_STD = 0.02

_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)  # fmt: skip


@dataclass(frozen=True)
class ZooModel:
    name: str
    config_class: str
    config: dict[str, Any]
    family: str
    tokenizer: bool = False
    #: the transformers class built (default: AutoModelForCausalLM from the config)
    model_class: str | None = None
    #: per-layer growth of the residual branches (output projections of attention and MLP
    #: scaled by growth**layer): residual activations then grow layer after layer, as in deep
    #: pretrained checkpoints
    growth: float = 1.0
    #: hidden channels that an early layer's MLP writes massive activations into (the few
    #: channels of hundreds to thousands that real LLMs carry through the residual stream)
    massive_channels: tuple[int, ...] = ()
    #: attention logits this many times larger (query and key projections each scaled by its
    #: square root): logits spanning tens, where a soft-capping of them engages, as in the
    #: pretrained checkpoints that cap them (the projections above give logits of order one)
    score_gain: float = 1.0
    #: the long requests' length in tokens (None: past the config's length boundaries,
    #: ``requests.long_length``)
    long: int | None = None


#: A deep model's massive channels come from this layer's MLP, this many times larger than
#: the other channels' contributions.
MASSIVE_LAYER, MASSIVE_SCALE = 1, 60.0


#: The long requests of the members a serving engine replays: past its KV block by the
#: margin every long request has.
SERVED_LONG = SERVING_BLOCK + LONG_MARGIN


ZOO: tuple[ZooModel, ...] = (
    ZooModel("tiny-llama", "LlamaConfig", _TEXT | {"num_hidden_layers": 2},
             "dense GQA decoder (Llama)", tokenizer=True),
    ZooModel("tiny-gemma2", "Gemma2Config", _TEXT | {
        "num_hidden_layers": 2, "sliding_window": 8, "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 16,
        "tie_word_embeddings": False,
    }, "sliding-window and global layers, logit soft-capping (Gemma 2)", score_gain=10.0),
    ZooModel("tiny-qwen3-moe", "Qwen3MoeConfig", _TEXT | {
        "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True,
    }, "mixture of experts (Qwen3-MoE)"),
    ZooModel("tiny-deepseek-v3", "DeepseekV3Config", {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 16, "max_position_embeddings": 256,
    }, "multi-head latent attention with MoE (DeepSeek-V3)"),
    ZooModel("tiny-qwen3-next", "Qwen3NextConfig", {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "full_attention_interval": 2,
        "max_position_embeddings": 256,
    }, "hybrid gated-delta-rule and full attention (Qwen3-Next)"),
    ZooModel("tiny-qwen2-vl", "Qwen2VLConfig", {
        "text_config": _TEXT | {"num_hidden_layers": 2, "bos_token_id": 1, "eos_token_id": 2,
                                "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                          "mlp_ratio": 2, "patch_size": 14, "temporal_patch_size": 2,
                          "spatial_merge_size": 2, "in_channels": 3},
        "image_token_id": 500, "video_token_id": 501, "vision_start_token_id": 502,
        "vision_end_token_id": 503, "bos_token_id": 1, "eos_token_id": 2,
    }, "image-text (Qwen2-VL)", model_class="Qwen2VLForConditionalGeneration"),
    # head dim 32, which vLLM's CPU attention serves: learned absolute positions, LayerNorm,
    # GELU, biases and an LM head tied to the embedding (GPT-2's own) through the engine (its
    # left-padded rows at the positions generation gives them,
    # ``requests.with_serving_positions``)
    ZooModel("tiny-gpt2", "GPT2Config", {
        "vocab_size": 512, "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 256,
        "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": True,
    }, "LayerNorm and GELU (GPT-2) at head dim 32, tied head", long=SERVED_LONG),
    # 24 layers of hidden 32: residual activations grow past 1e3 in the late layers (growth
    # 1.4 per layer) and two channels carry massive activations from layer 1 on, the regime
    # of 30-layer pretrained checkpoints, where a fixed distribution threshold false-alarms
    ZooModel("tiny-deep-llama", "LlamaConfig", {
        "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 24,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 256,
    }, "deep dense decoder with growing residuals and massive activations (Llama, 24 layers)",
        tokenizer=True, growth=1.4, massive_channels=(5, 21)),
    # Head dim 32, which vLLM's CPU attention serves (it takes 32 and 64, not the 16 of the
    # members above): the members the serving-engine replay (--engine vllm) runs on CPU, their
    # long requests past the serving engine's KV block (the prefix cache and preemption work
    # in whole blocks)
    ZooModel("tiny-mistral", "MistralConfig", _TEXT | {
        "num_hidden_layers": 2, "head_dim": 32, "sliding_window": 8,
    }, "sliding-window dense GQA decoder at head dim 32 (Mistral)", long=SERVED_LONG),
    ZooModel("tiny-mixtral", "MixtralConfig", _TEXT | {
        "num_hidden_layers": 2, "head_dim": 32, "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }, "mixture of experts at head dim 32 (Mixtral)", long=SERVED_LONG),
    ZooModel("tiny-qwen2-moe", "Qwen2MoeConfig", _TEXT | {
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": False,
    }, "mixture of experts with a gated shared expert at head dim 32 (Qwen2-MoE)",
        long=SERVED_LONG),
    ZooModel("tiny-bert", "BertConfig", {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 128, "hidden_act": "gelu",
    }, "encoder with a pooler, no logits (BERT / MiniLM)", model_class="BertModel"),
)  # fmt: skip

#: Words of the tiny tokenizer (with the built-in prompts' words).
_WORDS = (  # noqa: SIM905 - a sentence reads better than a list of fifty strings
    "the quick brown fox jumps over lazy dog while accelerator checks its numerics alignment "
    "means every layer agrees a an and of to in is it that on for with as was at by be this "
    "model kernel tensor float bfloat half drift budget error report token attention expert"
).split()


def rescale(model: Any, gemma_norms: bool | None) -> None:
    """The zoo's realistic magnitudes (module docstring) on a freshly initialised model.
    ``gemma_norms``: whether its norms multiply by (1 + weight); None: read it from each
    norm's initial weight (transformers initialises a (1 + w) norm at 0, others at 1)."""
    import torch

    embedding = model.get_input_embeddings().weight
    rescale_buffers(model)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.weight is embedding:
            continue  # an LM head tied to the embedding keeps the embedding's scale
        rescale_module(name, module, gemma_norms)


def rescale_buffers(module: Any) -> None:
    """The buffers :func:`rescale` draws (a router's score-correction bias), of ``module``
    and everything in it."""
    import torch

    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(ROUTER_BIAS_STD * torch.randn_like(buffer))


def rescale_module(name: str, module: Any, gemma_norms: bool | None) -> None:
    """:func:`rescale` for one module's own parameters (not its children's), ``name`` its
    name in the model: what a checkpoint written one layer at a time (``golden.synthetic``)
    applies module by module."""
    import torch

    if isinstance(module, torch.nn.Linear):
        fan_in = module.in_features
        gain = LM_HEAD_GAIN if name.endswith("lm_head") else 1.0
        torch.nn.init.normal_(module.weight, std=gain / fan_in**0.5)
        if module.bias is not None:
            torch.nn.init.normal_(module.bias, std=0.02)
    elif isinstance(module, torch.nn.Embedding):
        torch.nn.init.normal_(module.weight, std=EMBED_STD)
        with torch.no_grad():
            module.weight[:, ::OUTLIER_STRIDE] *= OUTLIER_SCALE
    elif "norm" in type(module).__name__.lower() and getattr(module, "weight", None) is not None:
        weight = module.weight
        if weight.dim() == 1:
            with torch.no_grad():
                # Gemma multiplies by (1 + weight): its weights sit around 0, others' at 1.
                if gemma_norms is None:
                    base = float(weight.float().mean().round())
                else:
                    base = 0.0 if gemma_norms else 1.0
                weight.copy_(base + 0.1 * torch.randn_like(weight))


def _deepen(model: Any, growth: float, massive: tuple[int, ...]) -> None:
    """Residual branches that grow with depth (each layer's attention and MLP output
    projections scaled by growth**layer) and massive activation channels written by one early
    layer's MLP: the activation statistics of deep pretrained checkpoints."""
    import torch

    layers = model.model.layers
    with torch.no_grad():
        for i, layer in enumerate(layers):
            layer.self_attn.o_proj.weight.mul_(growth**i)
            layer.mlp.down_proj.weight.mul_(growth**i)
        down = layers[MASSIVE_LAYER].mlp.down_proj.weight
        for channel in massive:
            down[channel] = down[channel].sign() * down.abs().mean() * MASSIVE_SCALE


def _sharpen(model: Any, gain: float) -> None:
    """Attention logits ``gain`` times larger: every query and key projection (and its bias)
    scaled by sqrt(gain)."""
    import torch

    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith((".q_proj", ".k_proj")):
                for tensor in (module.weight, module.bias):
                    if tensor is not None:
                        tensor.mul_(gain**0.5)


def _save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate([*specials, *_WORDS, ".", ","])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="<s>",
        eos_token="</s>",
    )
    fast.save_pretrained(folder)


def build_model(spec: ZooModel, out_dir: Path) -> Path:
    """Builds one zoo checkpoint deterministically into ``out_dir/<name>`` (replaced)."""
    import torch
    import transformers

    from numalign.ops.cases import stable_seed

    transformers.utils.logging.disable_progress_bar()
    config = getattr(transformers, spec.config_class)(**spec.config)
    torch.manual_seed(stable_seed("numalign.zoo", spec.name) % 2**31)
    if spec.model_class:
        model = getattr(transformers, spec.model_class)(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    rescale(model, gemma_norms=spec.config_class.startswith("Gemma"))
    if spec.growth != 1.0 or spec.massive_channels:
        _deepen(model, spec.growth, spec.massive_channels)
    if spec.score_gain != 1.0:
        _sharpen(model, spec.score_gain)
    model.eval()
    target = out_dir / spec.name
    tmp = out_dir / f".{spec.name}.build"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if spec.tokenizer:
        _save_tokenizer(tmp)
    (tmp / "ZOO.json").write_text(json.dumps({"family": spec.family}, indent=1) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def build_zoo(out_dir: str | Path, names: Sequence[str] | None = None) -> list[Path]:
    """Builds the zoo (or the named models of it) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    known = {m.name: m for m in ZOO}
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise ValueError(f"unknown zoo models {unknown}; the zoo: {', '.join(known)}")
    return [build_model(known[n], out) for n in (names or list(known))]
