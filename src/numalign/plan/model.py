"""The model a plan sizes, read without its weights: its config's sizes (``Shapes``) and its
parts in forward order (``Part``: the embedding, each decoder layer, the final norm, the
head), each with its parameter count, its routed experts and the values per token its
capture points output.

The parts come from the model built on the meta device (no tensor holds memory, whatever
the model's size: docs/plan.md); where that build fails (a model type transformers lacks,
remote code not trusted),
from config arithmetic (``_from_config``), and the plan says which.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numalign.golden.long_bound import CONFIG_SIZES

#: Config attributes of a size, first found wins: the long bound's (Llama's names, GPT-2's,
#: T5's) and those of MoE and MLA configs (Qwen3-MoE's, DeepSeek's, Mixtral's).
_NAMES = {
    **CONFIG_SIZES,
    "experts": ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "moe_topk", "top_k"),
    "moe_intermediate": ("moe_intermediate_size",),
    "shared_experts": ("n_shared_experts",),
    "first_dense": ("first_k_dense_replace",),
    "kv_lora_rank": ("kv_lora_rank",),
    "q_lora_rank": ("q_lora_rank",),
    "qk_rope": ("qk_rope_head_dim",),
    "qk_nope": ("qk_nope_head_dim",),
    "v_head": ("v_head_dim",),
}


@dataclass(frozen=True)
class Shapes:
    """The config's sizes a plan needs (0 where the config gives none)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int
    top_k: int
    moe_intermediate: int
    shared_experts: int
    first_dense: int
    kv_lora_rank: int
    q_lora_rank: int
    qk_rope: int
    qk_nope: int
    v_head: int
    tied: bool
    #: the dtype the checkpoint's weights are published in (config's dtype/torch_dtype)
    checkpoint_dtype: str

    @property
    def mla(self) -> bool:
        """DeepSeek's multi-head latent attention: the cache holds a compressed latent."""
        return self.kv_lora_rank > 0

    @property
    def kv_cache_values(self) -> int:
        """Values per token per layer in the reference's KV cache: keys and values of every KV
        head, or with MLA the latent (kv_lora_rank) and the rotary key (qk_rope_head_dim),
        which is what transformers' DeepseekV3Attention caches."""
        if self.mla:
            return self.kv_lora_rank + self.qk_rope
        return 2 * self.kv_heads * self.head_dim

    @property
    def kv_expanded_values(self) -> int:
        """Values per token of the keys and values one eager attention holds expanded to every
        query head (GQA's repeat_kv, MLA's kv_b_proj up-projection)."""
        if self.mla:
            return self.heads * (self.qk_nope + self.qk_rope + self.v_head)
        return 2 * self.heads * self.head_dim

    def mlp_values(self, moe: bool) -> int:
        """Intermediate values per token one MLP holds: the dense MLP's, or an MoE's top-k
        routed experts' and its shared experts'."""
        if not moe:
            return self.intermediate
        return (self.top_k + self.shared_experts) * (self.moe_intermediate or self.intermediate)


@dataclass(frozen=True)
class Part:
    """One part of the model in forward order. ``kind``: embedding, layer, norm or head.
    ``expert_params``: the routed experts' parameters (all ``experts`` of them; shared experts
    are dense). ``point_values``: values per token the part's capture points output (float32
    each in a set). ``signature``: equal for parts of the same parameter names and shapes."""

    name: str
    kind: str
    params: int
    expert_params: int = 0
    experts: int = 0
    point_values: int = 0
    signature: tuple[Any, ...] = ()
    #: each capture point of the part with its values per token (empty where the parts come
    #: from config arithmetic, which knows no point names)
    points: tuple[tuple[str, int], ...] = ()

    @property
    def moe(self) -> bool:
        return self.expert_params > 0


@dataclass(frozen=True)
class Structure:
    """A model's parts and sizes; ``built``: "meta device" or why config arithmetic stood in."""

    model_type: str
    architecture: str
    shapes: Shapes
    parts: tuple[Part, ...]
    built: str
    build_s: float

    @property
    def params(self) -> int:
        return sum(p.params for p in self.parts)


def shapes_of(config: Any) -> Shapes:
    """The sizes of ``config`` (its text config for multimodal models)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    found: dict[str, int] = {}
    for size, names in _NAMES.items():
        value = next((v for n in names if isinstance(v := getattr(text, n, None), int)), 0)
        found[size] = max(0, value)
    found["kv_heads"] = found["kv_heads"] or found["heads"]
    if not found["head_dim"] and found["heads"]:
        found["head_dim"] = found["hidden"] // found["heads"]
    found["intermediate"] = found["intermediate"] or 4 * found["hidden"]
    dtype = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or "float32"
    tied = bool(getattr(text, "tie_word_embeddings", False))
    return Shapes(**found, tied=tied, checkpoint_dtype=str(dtype).removeprefix("torch."))


def structure(model_dir: Path, *, trust_remote_code: bool = False) -> Structure:
    """The parts of the model in ``model_dir`` (its config.json alone is read): from the
    model built on the meta device, or from config arithmetic where that build fails."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=trust_remote_code
    )
    shapes = shapes_of(config)
    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    start = time.perf_counter()
    try:
        model = _meta_model(config, trust_remote_code)
        parts, built = _from_meta(model, shapes), "meta device"
        arch = type(model).__name__
    except Exception as exc:  # any failure of a model's own code: config arithmetic stands in
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        parts, built = _from_config(shapes), f"config arithmetic (the meta build failed: {reason})"
    return Structure(config.model_type, arch, shapes, parts, built, time.perf_counter() - start)


def _meta_model(config: Any, trust_remote_code: bool) -> Any:
    import torch
    import transformers

    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    auto: Any = transformers.AutoModelForCausalLM  # its from_config has no annotations
    with torch.device("meta"):
        return auto.from_config(config, trust_remote_code=trust_remote_code)


def _decoder_layers(model: Any) -> str:
    """The name of the ModuleList of decoder layers: the one holding the most parameters."""
    import torch

    lists: list[tuple[int, str]] = [
        (sum(p.numel() for p in m.parameters()), name)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) and not name.endswith("experts")
    ]
    if not lists:
        raise ValueError("no ModuleList of decoder layers in the model")
    return max(lists)[1]


def _from_meta(model: Any, shapes: Shapes) -> tuple[Part, ...]:
    """The parts of a meta model: parameters before the decoder layers (and the input
    embedding) are the embedding, those of the output embedding the head, the rest after the
    layers the final norm; a tied head shares the embedding's parameters and counts 0."""
    layers = _decoder_layers(model)
    out = model.get_output_embeddings()
    out_ids = {id(p) for p in out.parameters()} if out is not None else set()
    totals = {"embedding": 0, "norm": 0, "head": 0}
    per_layer: dict[int, list[tuple[str, Any]]] = {}
    for name, param in model.named_parameters():  # shared parameters once
        if name.startswith(layers + "."):
            index, _, rel = name[len(layers) + 1 :].partition(".")
            per_layer.setdefault(int(index), []).append((rel, param))
        elif id(param) in out_ids:
            totals["head"] += param.numel()
        else:
            totals["embedding" if not per_layer else "norm"] += param.numel()
    found = _point_values(model, layers, shapes)
    widths = {key: sum(w for _, w in points) for key, points in found.items()}

    def points(key: str) -> tuple[tuple[str, int], ...]:
        return tuple(found.get(key, ()))

    parts = [Part("embedding", "embedding", totals["embedding"], point_values=widths["embedding"],
                  points=points("embedding"))]  # fmt: skip
    for index in sorted(per_layer):
        params = per_layer[index]
        experts = [p for rel, p in params if "experts" in rel.split(".")]
        count = shapes.experts or (experts[0].shape[0] if experts else 0)
        parts.append(Part(
            f"layer {index}", "layer", sum(p.numel() for _, p in params),
            expert_params=sum(p.numel() for p in experts), experts=count if experts else 0,
            point_values=widths.get(f"layer {index}", 0),
            signature=tuple((rel, tuple(p.shape)) for rel, p in params),
            points=points(f"layer {index}"),
        ))  # fmt: skip
    parts.append(Part("final norm", "norm", totals["norm"], point_values=widths["norm"],
                      points=points("norm")))  # fmt: skip
    parts.append(Part("head", "head", totals["head"], point_values=widths["head"],
                      points=points("head")))  # fmt: skip
    return tuple(parts)


def _point_values(model: Any, layers: str, shapes: Shapes) -> dict[str, list[tuple[str, int]]]:
    """Each of the capture's default points (``golden.capture_points.default_points``) with
    the values per token it outputs, by part: a Linear its out_features, an Embedding its
    dimension, a norm its weight's size, a router its logits and top-k indices and weights,
    a rotary embedding its cos and sin, every other point (a layer, an attention, an MLP or
    MoE, its experts) one hidden-size tensor."""
    import torch

    from numalign.golden.capture_points import ROUTER_TYPES, default_points

    found: dict[str, list[tuple[str, int]]] = {"embedding": [], "norm": [], "head": []}
    seen_layers = False
    for name in default_points(model):
        module = model.get_submodule(name)
        kind = type(module).__name__
        if isinstance(module, torch.nn.Linear):
            width = module.out_features
        elif isinstance(module, torch.nn.Embedding):
            width = module.embedding_dim
        elif ROUTER_TYPES.search(kind):
            width = (shapes.experts or 1) + 2 * shapes.top_k
        elif kind.endswith("RotaryEmbedding"):
            width = 2 * 2 * int(getattr(module, "inv_freq", torch.zeros(0)).numel())
        elif kind.endswith("Norm") and getattr(module, "weight", None) is not None:
            width = int(module.weight.numel())
        else:
            width = shapes.hidden
        if name.startswith(layers + "."):
            seen_layers = True
            key = f"layer {name[len(layers) + 1 :].partition('.')[0]}"
        elif isinstance(module, torch.nn.Linear) or "LogitTransform" in kind:
            key = "head"
        elif kind.endswith("RotaryEmbedding"):  # computed before the layers, wherever it sits
            key = "embedding"
        else:
            key = "norm" if seen_layers else "embedding"
        found.setdefault(key, []).append((name, width))
    return found


def _from_config(s: Shapes) -> tuple[Part, ...]:
    """The parts by config arithmetic: a Llama-shaped layer (GQA or DeepSeek's MLA
    attention, without per-head q/k norms such as Qwen3's; a SwiGLU MLP, or routed experts,
    their router and shared experts from the ``first_k_dense_replace``-th layer on) and
    capture points of five hidden-size outputs per layer (the layer, its two norms, its
    attention and its MLP) and a router's."""
    h = s.hidden
    if s.mla:
        q = h * s.q_lora_rank + s.q_lora_rank * s.heads * (s.qk_nope + s.qk_rope)
        q = q if s.q_lora_rank else h * s.heads * (s.qk_nope + s.qk_rope)
        kv = h * (s.kv_lora_rank + s.qk_rope) + s.kv_lora_rank * s.heads * (s.qk_nope + s.v_head)
        norms = s.q_lora_rank + s.kv_lora_rank  # the latents' RMSNorms
        attention = q + kv + s.heads * s.v_head * h + norms
    else:
        attention = 2 * h * s.heads * s.head_dim + 2 * h * s.kv_heads * s.head_dim
    parts = [Part("embedding", "embedding", s.vocab * h, point_values=h)]
    for index in range(s.layers):
        moe = s.experts > 0 and index >= s.first_dense
        experts = s.experts * 3 * h * (s.moe_intermediate or s.intermediate) if moe else 0
        shared = 3 * h * s.shared_experts * s.moe_intermediate + s.experts * h if moe else 0
        dense = 0 if moe else 3 * h * s.intermediate
        parts.append(Part(
            f"layer {index}", "layer", attention + experts + shared + dense + 2 * h,
            expert_params=experts, experts=s.experts if moe else 0,
            point_values=5 * h + ((s.experts + 2 * s.top_k) if moe else 0),
            signature=("moe" if moe else "dense",),
        ))  # fmt: skip
    parts.append(Part("final norm", "norm", h, point_values=h))
    parts.append(Part("head", "head", 0 if s.tied else s.vocab * h, point_values=s.vocab))
    return tuple(parts)
