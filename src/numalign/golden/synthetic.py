"""A checkpoint of any size, written one streaming unit at a time: a model's config with
random weights of the zoo's realistic magnitudes (``golden.zoo.rescale``), saved as sharded
safetensors whose every shard holds one unit (a decoder layer, the embedding, the final
norm, the head). At no time does more than one unit exist in memory, so a checkpoint larger
than the machine's memory (a 7B-wide Llama of 36 layers, about 30 GB, on a 24 GiB machine)
is written on it, and what ``--stream`` captures and replays can be measured at the sizes
it is for: ``bench/bench_depth.py`` and ``tests/golden/test_stream_depth.py``.

The folder is a Hugging Face model folder like any other (``config.json``,
``model-*.safetensors``, ``model.safetensors.index.json``); ``from_pretrained`` loads it
where it fits. Its weights depend on the config and the seed name only, never on the
machine. It is written to a temporary folder beside ``out`` and renamed into place, so an
interrupted write leaves no half checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from numalign.ops.cases import stable_seed


def write_synthetic(config: Any, out: str | Path, *, seed: str = "numalign.synthetic") -> Path:
    """Writes a checkpoint of ``config`` (a ``PretrainedConfig`` of a causal LM) to ``out``
    (replaced), one unit per shard; returns ``out``. Its tied weights are written once,
    under their owner's name, as ``save_pretrained`` writes them."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from numalign.golden.stream import SHARD_INDEX, units_of
    from numalign.golden.zoo import rescale_buffers, rescale_module

    out = Path(out)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    config.architectures = [type(model).__name__]
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    units = units_of(model, tied)
    gemma_norms = "gemma" in str(getattr(config, "model_type", ""))
    tmp = out.parent / f".{out.name}.writing"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    try:
        for i, unit in enumerate(units, 1):
            module = model.get_submodule(unit)
            module.to_empty(device="cpu")
            torch.manual_seed(stable_seed(seed, unit) % 2**31)
            with torch.no_grad():
                for name, sub in module.named_modules():
                    model._init_weights(sub)  # the model's own init for what rescale leaves
                    rescale_module(f"{unit}.{name}" if name else unit, sub, gemma_norms)
                rescale_buffers(module)
            shard = f"model-{i:05d}-of-{len(units):05d}.safetensors"
            state = {
                f"{unit}.{key}": tensor.contiguous()
                for key, tensor in module.state_dict().items()
                if f"{unit}.{key}" not in tied
            }
            save_file(state, str(tmp / shard), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(state, shard))
            total += sum(t.numel() * t.element_size() for t in state.values())
            del state
            module.to_empty(device="meta")
        config.save_pretrained(tmp)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / SHARD_INDEX).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def llama_config(
    layers: int,
    *,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int | None = None,
    vocab: int = 32000,
    max_positions: int = 4096,
) -> Any:
    """A Llama config of the given shape (float32, untied head, eager attention's defaults):
    the shape the synthetic checkpoints of the depth measurements use."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        dtype="float32",
    )
