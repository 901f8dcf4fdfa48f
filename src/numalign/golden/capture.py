"""Capturing a golden set from a local Hugging Face model folder: capture only records.

Forward pre-hooks (with kwargs) and forward hooks on the capture points
(``golden.capture_points``) record each point's inputs and outputs while the reference
forward runs (``golden.recorder``, ``golden.request_recording``); tensors go to safetensors
shards of bounded size as they arrive (``shards.ShardWriter``), so peak memory stays near the
model plus one shard. A tensor two points share (one layer's output is the next one's input)
is stored once. Requests that generate also run a cached decode (``Decode``): the prefill
with a dynamic KV cache, then ``decode_steps`` steps of one token each, recording each step's
token, logits and the new token's outputs at every capture point, and the cache's contents
after the prefill and after the last step. A reference that is not finite is refused
(``golden.nonfinite``). The set is written into a temporary folder and renamed into place;
``finish`` runs on the finished temporary set first (``replay.ensemble.capture_calibrated``
calibrates there), so a set is never seen half-written. What to capture and how is a
``capture_spec.CaptureSpec``.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.golden.capture_manifest import started_manifest
from numalign.golden.capture_points import select_points
from numalign.golden.capture_spec import CaptureSpec
from numalign.golden.fingerprint import BackgroundFingerprint
from numalign.golden.folders import clear_temporary, remove_abandoned, temporary_folder
from numalign.golden.loading import load_reference, stream_choice
from numalign.golden.long_bound import check_long_request
from numalign.golden.progress import Progress, progress_mode
from numalign.golden.reference import takes_cache
from numalign.golden.request_recording import record_requests
from numalign.golden.requests import (
    DEFAULT_PROMPTS,
    CaptureRequest,
    far_request,
    image_request,
    long_length,
    long_requests,
    text_requests,
    with_serving_positions,
)
from numalign.golden.shards import ShardWriter
from numalign.golden.statistics_info import KeptWhole
from numalign.golden.store import GoldenSet, GoldenSetError, replace_set, write_manifest
from numalign.golden.target import check_target, keep_version

if TYPE_CHECKING:
    from numalign.golden.reference import Placement


def capture(model_dir: str | Path, out: str | Path, spec: CaptureSpec = CaptureSpec()) -> GoldenSet:
    """Captures a golden set of the model in ``model_dir`` into ``out`` as ``spec`` says
    (``CaptureSpec``, each field's contract there; the default: every default), replaced
    atomically: an interrupted capture leaves any previous set untouched and no partial
    folder. ``spec.finish(golden, step)`` runs on the whole set in its temporary folder
    before it is moved into place.

    ``out`` must not exist, be empty or hold a set of this model (``target.check_target``);
    ``spec.force`` replaces a set of another model, kept under ``<sets>/.versions/``. Bad
    options, and long requests past the model's positions or the memory, are refused before
    the model loads. Encoders get no long requests and no decode. For a model whose weights
    do not fit in memory, ``spec.placement`` or ``spec.stream`` give the same set."""
    model_dir, out = Path(model_dir).resolve(), Path(out)
    check_target(out, model_dir, force=spec.force)  # first: never load a model to then refuse
    spec.check()
    hashing, streamed, model = _checked_reference(model_dir, spec)
    decoder = takes_cache(model)
    requests = _requests(model_dir, model, spec, decoder=decoder)
    point_names = select_points(model, spec.points)

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out.parent)
    tmp = temporary_folder(out)
    bar = Progress(progress_mode(spec.progress), len(requests) + spec.finish_steps, out.name)
    try:
        manifest = started_manifest(model, model_dir, out, spec.reference_dtype)
        record_requests(model, requests, point_names, manifest,
                        ShardWriter(tmp, spec.max_shard_bytes), bar,
                        continuation=spec.continuation,
                        decode_steps=spec.decode_steps if decoder else 0, probes=spec.probes,
                        activations=not spec.points,
                        kept=KeptWhole.of(spec.full_points, spec.sketch_width))  # fmt: skip
        digest, files = hashing.result()
        manifest.model = replace(manifest.model, fingerprint=digest, files=files)
        if streamed:
            print(f"numalign capture: {hashing.throughput()}", file=sys.stderr, flush=True)
        write_manifest(tmp, manifest)
        del model
        if spec.finish is not None:
            spec.finish(GoldenSet.open(tmp), bar.step)
        _place(tmp, out, model_dir, force=spec.force)
    except BaseException:
        hashing.cancel()
        bar.close()
        clear_temporary(tmp)
        raise
    bar.close(done=True)
    return GoldenSet.open(out)


def _checked_reference(
    model_dir: Path, spec: CaptureSpec
) -> tuple[BackgroundFingerprint, bool, Any]:
    """The model folder's fingerprint and its files' being hashed on a thread of their own
    (``BackgroundFingerprint``: the hashing reads beside the capture's reads), whether the
    reference streams (``resolve_stream``), and the reference loaded whole, placed or
    streamed, seeded. The checks that need no model come first: a folder without
    config.json, or a sharded checkpoint missing a shard its index names, is an error naming
    the file before anything loads; so is a --long too long (``long_bound``)."""
    import torch

    # eager attention by default: the reference implementation, whose explicit 4D masks every
    # other attention implementation accepts when a point is replayed alone
    attn_implementation = spec.attn_implementation or "eager"
    hashing = BackgroundFingerprint(model_dir)
    try:
        check_long_request(model_dir, spec.long, max(spec.continuation, spec.decode_steps),
                           spec.reference_dtype, attn_implementation, spec.trust_remote_code,
                           in_memory=spec.placement is None)  # fmt: skip
        streamed = resolve_stream(model_dir, spec.reference_dtype, spec.stream, spec.placement)
        torch.manual_seed(0)
        model = load_reference(model_dir, spec.reference_dtype,
                               attn_implementation=attn_implementation,
                               trust_remote_code=spec.trust_remote_code,
                               placement=spec.placement, stream=streamed)  # fmt: skip
    except BaseException:
        hashing.cancel()
        raise
    return hashing, streamed, model


def resolve_stream(
    model_dir: str | Path, reference_dtype: str, stream: bool | None, placement: Placement | None
) -> bool:
    """Whether the capture streams its reference: as asked, or (``stream`` None) the
    automatic choice (``loading.stream_choice``), which prints why where it streams."""
    chosen, why = stream_choice(model_dir, reference_dtype, stream, placement=placement)
    if why:
        print(why, file=sys.stderr, flush=True)
    return chosen


def _requests(
    model_dir: Path, model: Any, spec: CaptureSpec, *, decoder: bool
) -> list[CaptureRequest]:
    """Every request of a capture, in order: the prompts, the long requests (``spec.long``
    None: past every length boundary of a decoder), the far-position request and the image
    request, each where the model and the options have one, a decoder's left-padded ones at
    the positions generation gives them (``with_serving_positions``); ValueError naming the
    option on bad sizes."""
    config, trust = model.config, spec.trust_remote_code
    requests = text_requests(model_dir, config, spec.prompts or DEFAULT_PROMPTS, trust)
    long = spec.long
    if long is None:
        long = long_length(config) if decoder else 0
    if long < 0:
        raise ValueError(f"--long {long}: a length in tokens, or 0 for no long requests")
    if long:
        requests += long_requests(model_dir, config, long, trust)
    far, max_position = spec.far, spec.max_position
    if far < 0 or (max_position is not None and max_position < 1):
        raise ValueError(
            f"--far {far} / --max-position {max_position}: tokens per far row (0 for none) and "
            "a position range of at least 1"
        )
    far_positions = far_request(model_dir, config, far, trust, max_position)
    requests += [far_positions] if far_positions is not None else []
    extra = image_request(model_dir, config, spec.image)
    requests += [extra] if extra is not None else []
    return [with_serving_positions(model, r) for r in requests] if decoder else requests


def _place(tmp: Path, out: Path, model_dir: Path, *, force: bool) -> None:
    """Moves the finished set from ``tmp`` into ``out``, keeping a replaced set under
    ``.versions/``; the target is checked again (it may have changed during the capture)."""
    if check_target(out, model_dir, force=force):
        kept = keep_version(out, _stamp(out))
        print(f"numalign capture: kept the replaced set under {kept}", file=sys.stderr)
    replace_set(tmp, out)


def _stamp(folder: Path) -> str:
    """When the set at ``folder`` was captured (its name under .versions), or ``unreadable``."""
    try:
        return GoldenSet.open(folder).manifest.created or "unknown"
    except GoldenSetError:
        return "unreadable"
