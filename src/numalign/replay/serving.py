"""Decode replay as the suites run it: a set's cached decode with a KV cache implementation
(``replay.decode``) or through the paged serving path (``replay.paged``), on the model the
session's settings ask for."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.replay.decode import DecodeVerdict, decode_unavailable, replay_decode
from numalign.replay.model import ModelCache, open_fresh
from numalign.replay.paged import PAGED_ATTENTION, PagedUnsupported, paged_divergence

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet
    from numalign.settings import Settings

__all__ = ["PagedUnsupported", "decode_replay", "known_divergence"]


def decode_replay(
    cache: ModelCache,
    path: str | Path,
    settings: Settings,
    device: torch.device,
    dtype: str,
    implementation: str,
    policy: Any = None,
) -> tuple[GoldenSet, Any, DecodeVerdict | None]:
    """The set at ``path`` (checked fresh), the model replayed and its decode verdict with
    ``implementation`` (model and verdict None when the set has no decode steps or no decode
    calibration: the caller skips with ``decode_unavailable``'s reason)."""
    golden = open_fresh(path)
    if decode_unavailable(golden, dtype) is not None:
        return golden, None, None
    if implementation != "paged":
        golden, model = cache.load(path, settings, device, dtype)
    elif settings.tp > 1:
        raise PagedUnsupported(
            "the paged serving path is not replayed tensor-parallel (--tp): its engine runs "
            "one process here; the KV caches are"
        )
    else:
        model = _paged_model(cache, golden, settings, device, dtype)
    verdict = cache.run(replay_decode, golden, model, dtype, device, implementation, policy)
    return golden, model, verdict


def _paged_model(
    cache: ModelCache, golden: GoldenSet, settings: Settings, device: torch.device, dtype: str
) -> Any:
    """The model the paged engine serves: with the session's attention implementation, else
    SDPA (``paged|sdpa``), else, for models without an SDPA path, the set's own (eager, which
    the engine runs as ``paged|eager``)."""
    from numalign.replay.model import ReplayUnsupported

    if settings.attn_implementation:
        return cache.model_for(golden, settings, device, dtype)
    try:
        return cache.model_for(golden, settings, device, dtype, attn_implementation=PAGED_ATTENTION)
    except ReplayUnsupported:
        return cache.model_for(golden, settings, device, dtype)


def known_divergence(model: Any, implementation: str) -> str | None:
    """A measured divergence of the serving path from the reference, where there is one
    (``replay.paged.paged_divergence``)."""
    return paged_divergence(model) if implementation == "paged" else None
