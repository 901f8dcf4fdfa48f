"""The reference model and how numalign observes it, shared by capture (which records) and
replay (which compares): loading a model from a local folder, the hooks that see each capture
point's inputs and outputs, flattening nested outputs into paths, the model's own outputs,
and the greedy step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: The model outputs kept when there are no logits (encoders), in this order.
ENCODER_OUTPUTS = ("last_hidden_state", "pooler_output")


def load_model(
    model_dir: Path,
    dtype: str,
    *,
    attn_implementation: str | None,
    trust_remote_code: bool,
    experts_implementation: str | None = None,
) -> Any:
    """A model from a local folder, offline, in ``dtype``, for inference."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = transformers.AutoConfig.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=trust_remote_code
    )
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        cls = transformers.AutoModelForCausalLM
    kwargs: dict[str, Any] = {
        "local_files_only": True,
        "dtype": getattr(torch, dtype),
        "trust_remote_code": trust_remote_code,
    }
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if experts_implementation:
        kwargs["experts_implementation"] = experts_implementation
    model = cls.from_pretrained(model_dir, **kwargs)
    model.eval()
    return model


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
    """(path, leaf) pairs of nested tuples, lists, dicts and ModelOutputs; tensors are leaves."""
    import torch

    if isinstance(value, torch.Tensor) or value is None:
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
    mask extended, and (image-text models) the new position marked as text."""
    import torch

    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], token], dim=1)
    out["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(token)], dim=1)
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
