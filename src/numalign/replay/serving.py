"""Decode replay as the suites run it: a set's cached decode with a KV cache implementation
(``replay.decode``) or through the paged serving path (``replay.paged``), on the model the
session's settings ask for."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.compare.decode_verdict import DecodeVerdict
from numalign.compare.signature import Signature, unexplained
from numalign.core import dtypes
from numalign.replay.decode import replay_decode, require_decode_replayable
from numalign.replay.decode_locate import locate_decode
from numalign.replay.model import ModelCache
from numalign.replay.paged import PAGED_ATTENTION, PagedUnsupported, paged_divergence
from numalign.replay.pipeline_split import PipelineUnsupported, decode_unsupported
from numalign.replay.sets import open_fresh

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet
    from numalign.session.settings import Settings

__all__ = ["PagedUnsupported", "decode_replay", "known_divergence"]


def decode_replay(
    cache: ModelCache,
    path: str | Path,
    settings: Settings,
    device: torch.device,
    dtype: str,
    implementation: str,
    policy: Any = None,
) -> tuple[GoldenSet, Any, DecodeVerdict]:
    """The set at ``path`` (checked fresh), the model replayed and its decode verdict with
    ``implementation``; raises why it cannot replay decode (``require_decode_replayable``:
    no decode steps, or no decode calibration)."""
    golden = open_fresh(path)
    require_decode_replayable(golden, dtype)
    if implementation != "paged":
        if settings.pp > 1 and (reason := decode_unsupported(golden.model_dir)) is not None:
            raise PipelineUnsupported(reason)
        golden, model = cache.load(path, settings, device, dtype)
    elif settings.tp > 1 or settings.pp > 1:
        raise PagedUnsupported(
            "the paged serving path is not replayed over ranks (--tp, --pp): its engine runs "
            "in one process here, holding every layer's KV cache; replay it without them"
        )
    else:
        model = _paged_model(cache, golden, settings, device, dtype)
    verdict = cache.run(replay_decode, golden, model, dtype, device, implementation, policy)
    first = verdict.first_failing if verdict is not None else None
    if first is not None and settings.tp == settings.pp == 1:  # ranks' models: not revisited
        verdict.location = locate_decode(golden, model, first, dtype, device, implementation,
                                         policy)  # fmt: skip
    return golden, model, verdict


def _paged_model(
    cache: ModelCache, golden: GoldenSet, settings: Settings, device: torch.device, dtype: str
) -> Any:
    """The model the paged engine serves: with the session's attention implementation, else
    SDPA (``paged|sdpa``), else, for models without an SDPA path, the set's own (eager, which
    the engine runs as ``paged|eager``)."""
    from numalign.compare.model_verdict import ReplayUnsupported

    if settings.attn_implementation:
        return cache.model_for(golden, settings, device, dtype)
    try:
        return cache.model_for(golden, settings, device, dtype, attn_implementation=PAGED_ATTENTION)
    except ReplayUnsupported:
        return cache.model_for(golden, settings, device, dtype)


def known_divergence(
    golden: GoldenSet,
    model: Any,
    verdict: DecodeVerdict,
    dtype: str,
    device: torch.device | str,
    implementation: str,
) -> str | None:
    """The reason a failed decode verdict is an expected failure, or None when it is not.

    A measured divergence of the serving path (``replay.paged.paged_divergence``: its
    kernels do not apply the attention soft-capping) is expected only where its signature
    matches: every failing point and logits of the verdict erred as the reference does with
    that feature removed (``signature_model``), within the point's own budget. Anything beyond
    it (a planted bug on top, a missing normalizer) is not explained and fails."""
    if implementation != "paged":
        return None
    reason = paged_divergence(model)
    if reason is None:
        return None
    if unexplained(verdict, _signature(golden, dtype, device)):
        return None
    return reason


def _signature(golden: GoldenSet, dtype: str, device: torch.device | str) -> Signature:
    """The errors of the signature model (the reference without soft-capping, decoded with
    the reference's cache) on every decode request."""
    import torch

    from numalign.golden.decode import REFERENCE_CACHE
    from numalign.replay.decode import run_decode
    from numalign.replay.paged import signature_model

    model = signature_model(golden, dtype, device)
    signature = Signature()
    with torch.no_grad():
        for request in golden.decode_requests:
            run_decode(golden, model, request, REFERENCE_CACHE, dtypes.torch_dtype(dtype),
                       device, signature.add)  # fmt: skip
    return signature
