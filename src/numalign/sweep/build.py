"""A tiny random checkpoint of any causal-LM type transformers ships: its config class with
the sizes of ``sweep.shrink``, the zoo's realistic weights (``golden.zoo.rescale``), checked to
run a forward before it is saved. A type transformers cannot build raises ``BuildError`` with
transformers' own message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from numalign.core.errors import Crashed
from numalign.sweep.shrink import shrink

#: Tokens of the forward a built model must run (batch 1).
CHECK_TOKENS = 8


class BuildError(Crashed, RuntimeError):
    """transformers could not build (or run) the type's tiny model; the message is its own."""


def causal_lm_types(image_text: bool = False) -> list[str]:
    """The model types of the installed transformers' causal-LM mapping (with the image-text
    mapping's where asked), in the mapping's order."""
    from transformers.models.auto import modeling_auto

    types = list(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if image_text:
        extra = modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        types += [t for t in extra if t not in types]
    return types


def auto_class(model_type: str) -> Any:
    """AutoModelForCausalLM for a causal-LM type, else AutoModelForImageTextToText."""
    import transformers
    from transformers.models.auto import modeling_auto

    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModelForImageTextToText


def tiny_config(model_type: str) -> Any:
    """The type's config with its sizes shrunk (``sweep.shrink``); an encoder's config taken
    as a causal LM is made a decoder (``as_decoder``)."""
    from transformers import AutoConfig

    try:
        defaults = AutoConfig.for_model(model_type).to_dict()
        kwargs = shrink(defaults, model_type)
        if auto_class(model_type).__name__ == "AutoModelForCausalLM":
            kwargs.update(as_decoder(defaults))
        return AutoConfig.for_model(model_type, **kwargs)
    except Exception as exc:
        raise BuildError(f"config: {type(exc).__name__}: {exc}") from exc


def as_decoder(defaults: dict[str, Any]) -> dict[str, Any]:
    """``is_decoder=True`` for an encoder's config (BERT, RoBERTa, BigBird: ``is_decoder``
    False, not an encoder-decoder) built as a causal LM, as its causal-LM class asks ("add
    `is_decoder=True`") and a checkpoint meant for generation has it: otherwise its attention
    is bidirectional, its mask built for the input rather than the cache, and its cache
    unused. Nothing for the other configs."""
    if defaults.get("is_decoder") is False and not defaults.get("is_encoder_decoder"):
        return {"is_decoder": True}
    return {}


def build_tiny(model_type: str, out_dir: Path) -> Path:
    """Builds ``model_type``'s tiny checkpoint into ``out_dir/<type>`` (replaced), checked to
    run a forward; BuildError with transformers' message where it cannot."""
    import torch
    import transformers

    from numalign.golden.zoo import rescale
    from numalign.ops.cases import stable_seed

    transformers.utils.logging.disable_progress_bar()
    config = tiny_config(model_type)
    torch.manual_seed(stable_seed("numalign.sweep", model_type) % 2**31)
    try:
        model = auto_class(model_type).from_config(config).eval()
        rescale(model, gemma_norms=None)
        vocab = int(model.get_input_embeddings().weight.shape[0])
        ids = torch.arange(3, 3 + CHECK_TOKENS).remainder(vocab)[None]
        with torch.no_grad():
            model(input_ids=ids)
        tmp = out_dir / f".{model_type}.build"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
    except Exception as exc:
        raise BuildError(f"{type(exc).__name__}: {exc}") from exc
    target = out_dir / model_type
    (tmp / "ZOO.json").write_text(json.dumps({"family": f"sweep: {model_type}"}) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
