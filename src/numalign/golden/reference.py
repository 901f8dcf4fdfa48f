"""The reference model and how numalign observes it, shared by capture (which records) and
replay (which compares): loading a model from a local folder, the hooks that see each capture
point's inputs and outputs, flattening nested outputs into paths, the model's own outputs,
the greedy step, and the cached decode (a KV cache of a named implementation, one decode
step's inputs, and the cache's contents in one layout whatever the implementation).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.core.errors import Unsupported
from numalign.session.option_values import KV_CACHES

if TYPE_CHECKING:
    import torch

#: The model outputs kept when there are no logits (encoders), in this order.
ENCODER_OUTPUTS = ("last_hidden_state", "pooler_output")


@dataclass(frozen=True)
class Placement:
    """Big-model loading (accelerate, through from_pretrained's ``device_map``): modules
    placed by ``device_map`` (``auto``: accelerators first, then CPU memory, then disk) within
    ``max_memory`` per device (``{"cpu": "200MB"}``), the rest offloaded to
    ``offload_folder`` and loaded module by module as the forward reaches it. A model whose
    weights do not fit in memory is captured this way."""

    device_map: str = "auto"
    offload_folder: Path | None = None
    max_memory: dict[str, str] | None = None

    def kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"device_map": self.device_map}
        if self.offload_folder is not None:
            kwargs["offload_folder"] = str(self.offload_folder)
        if self.max_memory:
            kwargs["max_memory"] = {
                int(k) if k.isdigit() else k: v for k, v in self.max_memory.items()
            }
        return kwargs


def parse_max_memory(text: str) -> dict[str, str]:
    """``"cpu=200MB,0=20GiB"`` -> ``{"cpu": "200MB", "0": "20GiB"}``; ValueError otherwise."""
    memory = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        device, sep, size = part.partition("=")
        if not sep or not device or not size or not size[0].isdigit():
            raise ValueError(
                f"--max-memory {text!r}: write DEVICE=SIZE pairs, e.g. cpu=200MB or "
                "0=20GiB,cpu=64GiB"
            )
        memory[device.strip()] = size.strip()
    return memory


def load_model(
    model_dir: Path,
    dtype: str,
    *,
    attn_implementation: str | None,
    trust_remote_code: bool,
    experts_implementation: str | None = None,
    tp_plan: str | None = None,
    placement: Placement | None = None,
) -> Any:
    """A model from a local folder, offline, in ``dtype``, for inference; with ``tp_plan``
    (``"auto"``), this rank's shard of it (torch.distributed must be running); with
    ``placement``, placed and offloaded by accelerate (``Placement``)."""
    import transformers

    from numalign.core.dtypes import torch_dtype

    transformers.utils.logging.disable_progress_bar()
    _, cls = model_class(model_dir, trust_remote_code)
    kwargs: dict[str, Any] = {
        "local_files_only": True,
        "dtype": torch_dtype(dtype),
        "trust_remote_code": trust_remote_code,
        **implementations(attn_implementation, experts_implementation),
    }
    if tp_plan:
        kwargs["tp_plan"] = tp_plan
    if placement is not None:
        kwargs.update(placement.kwargs())
    try:
        model = cls.from_pretrained(model_dir, **kwargs)
    except Exception as exc:
        # torch refused an object of a weights-only load (pickle's UnpicklingError; by name:
        # this package imports no pickle module)
        if type(exc).__name__ != "UnpicklingError":
            raise
        detail = next((ln.strip() for ln in str(exc).splitlines() if "Unsupported" in ln), "")
        raise ValueError(
            f"{model_dir}: its PyTorch checkpoint holds objects that are not plain tensors "
            f"({detail or 'weights_only refused it'}); numalign never unpickles them. Convert "
            "it to safetensors where you trust it: model.save_pretrained(DIR, "
            "safe_serialization=True)"
        ) from None
    model.eval()
    attach_points(model)
    return model


def model_class(model_dir: str | Path, trust_remote_code: bool) -> tuple[Any, Any]:
    """The folder's config and the transformers class its ``architectures`` names (the
    causal-LM auto class where it names none transformers has)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=trust_remote_code
    )
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    return config, cls if cls is not None else transformers.AutoModelForCausalLM


def implementations(attention: str | None, experts: str | None) -> dict[str, str]:
    """The loading keyword arguments of the attention and experts implementations asked
    for (none: the model's own)."""
    asked = {"attn_implementation": attention, "experts_implementation": experts}
    return {key: value for key, value in asked.items() if value}


def attach_points(model: Any) -> None:
    """What the model computes outside its modules, as modules (capture points): the masks
    it builds, what it does to its logits after the LM head."""
    from numalign.golden.logit_transform import attach_logit_transform
    from numalign.golden.mask_points import attach_mask_points

    attach_mask_points(model)
    attach_logit_transform(model)


def forward_kwargs(model: Any) -> dict[str, Any]:
    """Keyword arguments of a reference forward: no KV cache, where the model has one."""
    import inspect

    takes = "use_cache" in inspect.signature(model.forward).parameters
    return {"use_cache": False} if takes else {}


def model_outputs(result: Any) -> dict[str, torch.Tensor]:
    """The model's own outputs that a golden set keeps: the logits of a language model, or an
    encoder's last hidden state and pooled output. Anything else is an error naming the
    output type."""
    logits = getattr(result, "logits", None)
    if logits is not None:
        return {"logits": logits}
    found: dict[str, torch.Tensor] = {
        k: getattr(result, k) for k in ENCODER_OUTPUTS if getattr(result, k, None) is not None
    }
    if not found:
        raise TypeError(
            f"the model returned {type(result).__name__}, which has neither logits nor "
            f"{' nor '.join(ENCODER_OUTPUTS)}: numalign captures causal and masked language "
            "models, image-text models and encoders; capture another head of this model (its "
            "...ForCausalLM or ...Model class) or open an issue with the output type"
        )
    return found


@contextmanager
def hooks(
    model: torch.nn.Module,
    points: Sequence[str],
    on_call: Callable[[str, tuple[Any, ...], dict[str, Any], Any], None],
) -> Iterator[None]:
    """Calls ``on_call(point, args, kwargs, output)`` after each call of each point."""
    handles = []
    pending: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
    for name in points:
        module = model.get_submodule(name)

        def pre(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str = name) -> None:
            pending.setdefault(name, []).append((args, dict(kwargs)))

        def post(
            mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, name: str = name
        ) -> None:
            saved_args, saved_kwargs = pending[name].pop()
            on_call(name, saved_args, saved_kwargs, output)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs of nested tuples, lists, dicts and ModelOutputs; tensors are leaves,
    a complex one as its real view (DeepSeek-V2's rotary ``freqs_cis``: [..., 2] of real and
    imaginary parts), so that every output is compared as real numbers."""
    import torch

    if isinstance(value, torch.Tensor) and value.is_complex():
        yield prefix or "0", torch.view_as_real(value)
    elif isinstance(value, torch.Tensor) or value is None:
        yield prefix or "0", value
    elif isinstance(value, dict) or (hasattr(value, "to_tuple") and hasattr(value, "keys")):
        for k in value:  # dicts and ModelOutputs iterate their keys
            yield from flatten(value[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from flatten(item, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix or "0", value


def jsonable(value: Any) -> Any:
    """A JSON value for simple kwargs; a marked repr for anything else."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)) and all(
        v is None or isinstance(v, (bool, int, float, str)) for v in value
    ):
        return list(value)
    return {"__repr__": type(value).__name__}


def append_token(inputs: dict[str, Any], token: torch.Tensor) -> dict[str, Any]:
    """The model inputs one greedy step later: ``token`` [batch, 1] appended to the ids, the
    mask extended, explicit positions (a far-position request's) one further, and
    (image-text models) the new position marked as text."""
    import torch

    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], token], dim=1)
    out["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(token)], dim=1)
    if "position_ids" in inputs:  # a request at explicit positions goes on from its last
        positions = inputs["position_ids"]
        out["position_ids"] = torch.cat([positions, positions[..., -1:] + 1], dim=-1)
    if "mm_token_type_ids" in inputs:
        out["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros_like(token)], dim=1
        )
    return out


def greedy_step(model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """One greedy step without a cache: the next token [batch, 1] and the last position's
    logits [batch, vocab]."""
    logits = model(**inputs, **forward_kwargs(model)).logits[:, -1]
    return logits.argmax(-1, keepdim=True), logits


# -- cached decode ------------------------------------------------------------------------------
#: The cache implementation whose place a model's own cache takes (what generation builds).
OWN_CACHE_STANDS_FOR = "dynamic"


class CacheUnsupported(Unsupported, RuntimeError):
    """The model cannot decode with the asked-for cache (it builds a cache class of its own):
    a decode replay with that cache is skipped with the reason."""


def own_cache(model: Any) -> str | None:
    """Why the model takes no cache numalign builds (it builds its own, as transformers'
    ``generate`` lets it: MiniMax's ``MiniMaxCache``), or None when it takes a
    ``DynamicCache``/``StaticCache``."""
    supports = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports is None or supports():
        return None
    return (
        f"{type(model).__name__} builds a cache of its own (transformers' generate passes it "
        "none: _supports_default_dynamic_cache is False)"
    )


def filled_cache(output: Any, cache: Any) -> Any:
    """The cache a prefill filled: ``cache`` itself, or where it was None (a model with its own
    cache class, ``own_cache``) the one the forward returned."""
    if cache is not None:
        return cache
    return getattr(output, "cache", None) or getattr(output, "past_key_values", None)


def new_cache(model: Any, implementation: str, max_len: int) -> Any:
    """An empty KV cache of ``implementation`` (one of ``option_values.KV_CACHES``, transformers'
    ``cache_implementation`` names) for ``model``, holding at least ``max_len`` positions; its
    layers follow the model's config (sliding window, linear attention). None for a model that
    builds its own (``own_cache``) where ``implementation`` is the dynamic one: the prefill
    builds it (``filled_cache``); CacheUnsupported for any other implementation there."""
    from transformers import DynamicCache, StaticCache

    if implementation not in KV_CACHES:
        raise ValueError(
            f"unknown KV cache implementation {implementation!r}; allowed: {', '.join(KV_CACHES)}"
        )
    own = own_cache(model)
    if own is not None:
        if implementation == OWN_CACHE_STANDS_FOR:
            return None  # the model's forward builds its own; ``filled_cache`` takes it back
        raise CacheUnsupported(f"{own}: a {implementation} cache is not one it takes")
    offloading = implementation.startswith("offloaded")
    # a streamed model's parameters are on meta between units: it names its device itself
    device = getattr(model, "device", None) or next((p.device for p in model.parameters()), None)
    if offloading and (device is None or device.type == "cpu"):
        raise CacheUnsupported(
            f"a {implementation} cache moves layers between an accelerator and the CPU (it "
            "calls torch.cuda); the model is on the CPU, with nothing to offload: replay it "
            "with --device cuda, or the dynamic and static caches here"
        )
    if implementation.endswith("static"):
        return StaticCache(config=model.config, max_cache_len=max_len, offloading=offloading)
    return DynamicCache(config=model.config, offloading=offloading)


def cache_argument(model: Any) -> str | None:
    """The name under which the model's forward takes its KV cache: ``cache`` (transformers
    5.20 and later), ``past_key_values`` (before); None for a model that takes none."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def takes_cache(model: Any) -> bool:
    """Whether the model's forward takes a KV cache (decoders do; encoders do not decode)."""
    return cache_argument(model) is not None and hasattr(model, "generate")


def reset_decode_state(model: Any) -> None:
    """Forgets what a model keeps between forwards of one generation: image-text models with
    multimodal rotary positions keep the prefill's position offsets (``rope_deltas``), which
    must not leak into the next request's decode."""
    for module in model.modules():
        if getattr(module, "rope_deltas", None) is not None:
            module.rope_deltas = None


def generation_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as generation derives them from the attention mask: each real token's
    index among the real tokens of its row, padding at 0. A left-padded row then has the
    positions an unpadded request of its tokens has (what a serving engine, which never pads,
    computes), so its decode is comparable with any engine's."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def prefill_kwargs(model: Any, inputs: dict[str, Any], cache: Any) -> dict[str, Any]:
    """Keyword arguments (besides ``inputs``) of a prefill that fills ``cache``: generation's
    positions, except for image requests, whose multimodal rotary positions the model derives
    itself from the image grid, and requests at explicit positions (given in ``inputs``)."""
    kwargs: dict[str, Any] = {cache_argument(model) or "cache": cache, "use_cache": True}
    if "position_ids" in inputs:  # a request at explicit positions keeps them
        return kwargs
    if "pixel_values" not in inputs and "attention_mask" in inputs:
        kwargs["position_ids"] = generation_positions(inputs["attention_mask"])
    return kwargs


#: ``steps_see_whole_sequence``'s answer per model, asked once.
_WHOLE_SEQUENCE: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def steps_see_whole_sequence(model: Any) -> bool:
    """Whether the model's own generation feeds each cached step the whole sequence rather
    than the new token, as its ``prepare_inputs_for_generation`` answers for a step of one
    new token: ids as long as the sequence or longer. CpmAnt's and XLM's forwards slice off
    what their cache holds themselves (fed the new token alone, CpmAnt prepends its prompt
    again and misaligns its position bias, and XLM's mask, as long as the sequence, fails its
    length check); XLM's generation also appends a mask token to predict at, which numalign
    does not: its steps predict from the last position, as its prefill and uncached
    continuation do. False where the model does not say (no such method, or one that needs
    more than the ids)."""
    import torch

    known = _WHOLE_SEQUENCE.get(model)
    if known is not None:
        return known
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    ids = torch.zeros(1, 2, dtype=torch.long)
    try:
        asked = prepare(ids, next_sequence_length=1) if prepare is not None else None
    except Exception:  # a model whose generation wants more (images, a cache): the usual step
        asked = None
    fed = asked.get("input_ids") if isinstance(asked, dict) else None
    whole = isinstance(fed, torch.Tensor) and fed.dim() == 2 and fed.shape[1] >= ids.shape[1]
    _WHOLE_SEQUENCE[model] = whole
    return whole


def decode_inputs(
    model: Any, inputs: dict[str, Any], token: torch.Tensor, cache: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One decode step: the whole sequence's inputs one token later (to carry on) and the
    step's forward arguments: the new token [batch, 1] (the whole sequence where the model's
    generation asks for it, ``steps_see_whole_sequence``), the extended attention mask, the
    cache, and the new token's position as generation derives it (for multimodal rotary
    positions, plus the offsets the prefill left in the model's ``rope_deltas``; a request at
    explicit positions goes on from its last)."""
    grown = append_token(inputs, token)
    if "position_ids" in grown:
        positions = grown["position_ids"]
    else:
        positions = generation_positions(grown["attention_mask"])
    whole = steps_see_whole_sequence(model)
    step: dict[str, Any] = {
        "input_ids": grown["input_ids"] if whole else token,
        "attention_mask": grown["attention_mask"],
        cache_argument(model) or "cache": cache,
        "use_cache": True,
        "position_ids": positions if whole else positions[..., -1:],
    }
    position = positions[..., -1:]
    if "mm_token_type_ids" in grown:
        types = grown["mm_token_type_ids"]
        step["mm_token_type_ids"] = types if whole else types[:, -1:]
    deltas = next(
        (m.rope_deltas for m in model.modules() if getattr(m, "rope_deltas", None) is not None),
        None,
    )
    if deltas is not None:
        step["position_ids"] = (position + deltas.to(token.device))[None].expand(3, -1, -1)
    return grown, step


def cache_state(cache: Any) -> dict[str, torch.Tensor]:
    """The cache's contents by state name, in one layout whatever the implementation: per
    attention layer ``layers.N.keys`` and ``layers.N.values`` [batch, heads, positions, dim]
    holding the most recent positions the layer keeps, oldest first (a static layer's unused
    capacity cut off; a sliding-window layer's window); per linear-attention layer
    ``layers.N.conv_states.J`` and ``layers.N.recurrent_states.J``. A model's own cache
    without transformers' ``layers`` is read as it holds its states (``own_cache_states``)."""
    if getattr(cache, "layers", None) is None:
        return own_cache_states(cache)
    out: dict[str, torch.Tensor] = {}
    for i, linear in enumerate(getattr(cache, "linear_cache", None) or ()):
        if hasattr(linear, "shape"):  # MiniMax's own cache: a linear-attention layer's state
            out[f"layers.{i}.linear_state"] = linear
    for i, layer in enumerate(cache.layers):
        for kind in ("conv_states", "recurrent_states"):
            for j, state in (getattr(layer, kind, None) or {}).items():
                if state is not None:
                    out[f"layers.{i}.{kind}.{j}"] = state
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None or keys.numel() == 0:
            continue
        seen = int(layer.get_seq_length()) if hasattr(layer, "get_seq_length") else keys.shape[-2]
        held = min(seen, keys.shape[-2])
        out[f"layers.{i}.keys"] = keys[..., :held, :]
        out[f"layers.{i}.values"] = values[..., :held, :]
    return out


def own_cache_states(cache: Any) -> dict[str, torch.Tensor]:
    """The states a model's own cache holds without transformers' ``layers`` API (xLSTM's
    ``xLSTMCache``: ``rnn_state.L.J``, the recurrent state J of layer L), named by their
    attribute paths in the cache: its floating-point tensors, nested in lists, tuples and
    dicts. Counters and indices (xLSTM's ``seqlen_offset``) are left out: the positions they
    count are the steps' own, and a wrong one shows in the states and logits."""
    import torch

    held = {name: value for name, value in vars(cache).items() if not name.startswith("_")}
    return {
        path: state
        for path, state in flatten(held)
        if isinstance(state, torch.Tensor) and state.is_floating_point()
    }
