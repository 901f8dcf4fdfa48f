"""Decode replay as the suites run it: a set's cached decode with a KV cache implementation
(``replay.decode``) or through the paged serving path (``replay.paged``), on the model the
session's settings ask for."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign import dtypes
from numalign.compare.decode_verdict import DecodeVerdict
from numalign.replay.decode import decode_unavailable, replay_decode
from numalign.replay.decode_locate import locate_decode
from numalign.replay.leans import POOLED
from numalign.replay.model import ModelCache, open_fresh
from numalign.replay.paged import PAGED_ATTENTION, PagedUnsupported, paged_divergence

if TYPE_CHECKING:
    import torch

    from numalign.compare.lean import Lean
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
    first = verdict.first_failing if verdict is not None else None
    if first is not None and settings.tp == 1:  # ranks hold shards: not revisited
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
    unexplained = _unexplained(golden, verdict, dtype, device)
    if unexplained:
        return None
    return reason


def _unexplained(
    golden: GoldenSet, verdict: DecodeVerdict, dtype: str, device: torch.device | str
) -> list[str]:
    """The failing results of ``verdict`` whose errors differ from the signature model's
    (the reference without soft-capping, decoded with the reference's cache) by more than
    their budget."""
    import torch

    from numalign.compare import compute_metrics
    from numalign.compare.lean import LeanSums
    from numalign.compare.logits import logits_stats
    from numalign.golden.decode import REFERENCE_CACHE
    from numalign.golden.manifest import OUTPUT_POINT
    from numalign.replay.decode import run_decode
    from numalign.replay.paged import signature_model

    torch_dtype = dtypes.torch_dtype(dtype)
    model = signature_model(golden, dtype, device)
    errors: dict[tuple[str, int, str, str, int], tuple[float, float, float]] = {}
    leans: dict[tuple[str, str], LeanSums] = {}

    def on_pair(request: str, step: int, point: str, path: str, actual: Any,
                expected: Any, call: int = 0) -> None:  # fmt: skip
        m = compute_metrics(actual, expected)
        kl = logits_stats(actual, expected, 0.0).kl_max if point == OUTPUT_POINT else 0.0
        errors[(request, step, point, path, call)] = (m.max_abs, m.rel_l2, kl)
        leans.setdefault((point, path), LeanSums()).add(actual, expected)

    with torch.no_grad():
        for request in golden.decode_requests:
            run_decode(golden, model, request, REFERENCE_CACHE, torch_dtype, device, on_pair)
    out = []
    for r in verdict.points:
        if r.result.passed:
            continue
        if r.request == POOLED:  # a pooled lean: against the signature model's own lean
            sums = leans.get((r.point, r.path))
            if sums is None or not _same_lean(r.result.budget, sums.finish()):
                out.append(f"{r.point}'s pooled lean")
            continue
        signature = errors.get((r.request, r.step or 0, r.point, r.path, r.call))
        if signature is None or not _within(r.result, signature[:2]):
            out.append(f"{r.point} at step {r.step}, request {r.request}")
    for lg in verdict.logits:
        if lg.passed or lg.values is None or lg.stats is None:
            continue
        signature = errors.get((lg.request, lg.step or 0, OUTPUT_POINT, "logits", 0))
        # to second order a KL divergence is a squared distance (half the chi-squared of the
        # log-ratio), so the engine's and the signature's distances from the reference differ
        # by at most the distance between them: within the budget's when they agree
        kl_ok = signature is not None and abs(
            math.sqrt(max(lg.stats.kl_max, 0.0)) - math.sqrt(max(signature[2], 0.0))
        ) <= math.sqrt(lg.kl_budget)
        if signature is None or not (_within(lg.values, signature[:2]) and kl_ok):
            out.append(f"the logits at step {lg.step}, request {lg.request}")
    return out


def _same_lean(budget: dict[str, float], signature: Lean | None) -> bool:
    """The engine's pooled lean (``budget``'s ``lean_scale`` and ``lean_offset``, from
    ``replay.leans``) is one the signature model explains: of the signature's sign where it
    leans beyond the honest range, and no larger than the signature's lean plus the honest
    range's width (widened by the upstream allowance both ways) and three standard errors of
    each (the signature decodes with the reference's cache, so its steps' errors differ in
    detail, not in kind)."""
    if signature is None:
        return False
    upstream = budget.get("lean_upstream", 0.0)
    for kind in ("scale", "offset"):
        width = budget.get(f"{kind}_high", 0.0) - budget.get(f"{kind}_low", 0.0) + 2 * upstream
        se = math.hypot(budget.get(f"lean_{kind}_se", 0.0), getattr(signature, f"{kind}_se"))
        engine, explained = budget.get(f"lean_{kind}", 0.0), getattr(signature, kind)
        allowed = width + 3 * se
        if abs(engine) > allowed and (
            engine * explained < 0 or abs(engine) > abs(explained) + allowed
        ):
            return False
    return True


def _within(result: Any, signature: tuple[float, float]) -> bool:
    """The result's max abs and relative L2 errors equal the signature's within its budget."""
    budget, metrics = result.budget, result.metrics
    same_max = abs(metrics.max_abs - signature[0]) <= budget.get("max_abs", 0.0)
    return bool(same_max and abs(metrics.rel_l2 - signature[1]) <= budget.get("rel_l2", 0.0))
