"""How ``--pp N`` splits a model, from its config alone, before any rank starts: the decoder
layers each rank holds (vLLM's split, :func:`split_layers`), the layout records name, and
what pipeline-parallel replay does not split. ``numalign plan`` sizes its ranks by the same
split; ``replay.pipeline`` runs it."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from numalign.compare.model_verdict import ReplayUnsupported
from numalign.core.errors import UsageError


class PipelineUsageError(UsageError, ValueError):
    """A ``--pp`` the model cannot be split over (more ranks than decoder layers)."""


class PipelineUnsupported(ReplayUnsupported):
    """A model or replay path that pipeline-parallel replay does not split (the suites skip
    with the reason)."""


def split_layers(depth: int, ranks: int) -> list[range]:
    """The decoder layers each rank holds: contiguous ranges in order, as even as ``depth``
    divides; where it does not, the ``depth % ranks`` layers over go one each to the ranks
    before the last, from the last but one back, as vLLM's pipeline splits them (the first
    and last ranks hold the embedding and the head), so the stages replayed are the ones a
    vLLM deployment of the model serves."""
    if ranks > depth:
        raise PipelineUsageError(
            f"{ranks} pipeline ranks for {depth} decoder layers would leave a rank none; "
            f"choose a --pp of at most {depth}"
        )
    base, extra = divmod(depth, ranks)
    sizes = [base] * ranks
    for back in range(2, extra + 2):
        sizes[-back] += 1
    starts = [sum(sizes[:rank]) for rank in range(ranks)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def layout(depth: int, ranks: int) -> str:
    """The ranks' layers as records and messages name them: ``0-1|2-3``."""
    return "|".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)
                    for r in split_layers(depth, ranks))  # fmt: skip


@functools.lru_cache(maxsize=64)
def check_pipelinable(model_dir: str | Path, ranks: int) -> str:
    """The model's layers over ``ranks`` (:func:`layout`), from the config alone, before any
    rank starts: PipelineUnsupported for a model that is not a causal language model of text
    (an encoder, an image-text model: their units before the decoder are not an embedding a
    stage can stand in for), PipelineUsageError for more ranks than decoder layers."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    if not arch.endswith(("ForCausalLM", "LMHeadModel")) or hasattr(config, "vision_config"):
        raise PipelineUnsupported(
            f"pipeline-parallel replay splits a causal language model's decoder layers over "
            f"the ranks; {arch} is not one (an encoder or an image-text model): replay it "
            "without --pp"
        )
    try:
        return layout(depth_of(config), ranks)
    except PipelineUsageError as exc:
        raise PipelineUsageError(f"{Path(model_dir).name}: {exc}") from None


def depth_of(config: Any) -> int:
    """The decoder layers ``config`` (its text config) names (1 where it names none); the
    depth every replay reads (``replay.model.hidden_and_depth`` too)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None) or 1)


def decode_unsupported(model_dir: str | Path) -> str | None:
    """Why decode cannot be replayed pipeline-parallel on the model (None when it can). A
    linear-attention layer's states sit in transformers' layered cache, read only by the
    rank that holds the layer (the stand-ins keep the attention layers' places, by which the
    cache counts positions); state-space (``mamba``) and convolution (``conv``) layers have
    not been replayed so: refused, not guessed."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text, "layer_types", None) or ())
    if kinds & {"mamba", "conv"}:
        return (
            "decode replay pipeline-parallel (--pp) has been shown on attention and "
            "linear-attention layers' caches, not yet on state-space (mamba) or convolution "
            "(conv) layers': replay this model's decode without --pp"
        )
    return None
