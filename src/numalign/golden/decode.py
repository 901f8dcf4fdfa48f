"""Capturing a request's cached decode (part of a capture, which only records): the prefill
with a KV cache, then steps of one greedy token each; per step the token, the logits and the
new token's outputs at every capture point; the cache's contents after the prefill and after
the last step (``golden.manifest.Decode``).

Growth per step: each capture point's new-token outputs ([batch, 1, hidden] per output; a
router's routing, its one token per row, as [batch, 1, experts]: ``step_outputs``) plus
the logits [batch, vocab] and the token, deduplicated by content like every stored tensor;
the two cache snapshots hold the keys and values (or linear-attention states) of every layer.
"""

from __future__ import annotations

from typing import Any

from numalign.compare.routing import ROUTING
from numalign.compare.tolerances import CACHE_LIMIT_DISAGREEMENT
from numalign.golden.manifest import Decode, DecodeStep
from numalign.golden.reference import (
    cache_state,
    decode_inputs,
    filled_cache,
    hooks,
    new_cache,
    prefill_kwargs,
    reset_decode_state,
)
from numalign.golden.requests import CaptureRequest
from numalign.golden.routing import point_tensors
from numalign.golden.shards import ShardWriter

#: Decode steps a capture records per generating request: enough to see a cache grow past
#: the prefill, small enough that a set grows by a few hidden states per step.
DEFAULT_DECODE_STEPS = 4
#: The cache implementation the reference decodes with.
REFERENCE_CACHE = "dynamic"
#: The other cache the reference tries at capture, one step per request: a model whose code
#: cannot decode with it (BLOOM builds its ALiBi bias from the input's mask, not from the
#: static cache's length) has the limit written into its set, and replay skips that cache
#: with the reason instead of crashing. The offloaded static cache shares the static one's
#: limits; the offloaded dynamic one is the dynamic cache moved, and the paged engine
#: detects its own (``replay.paged``).
PROBED_CACHES = ("static",)
#: Characters of the reference's error kept as a limit's reason.
LIMIT_CHARS = 300


def record_decode(
    model: Any, request: CaptureRequest, point_names: list[str], writer: ShardWriter, steps: int
) -> Decode:
    """The request's prefill with a KV cache, then ``steps`` greedy steps of one token: each
    step's token, logits and the new token's outputs at every point, and the cache's contents
    after the prefill and after the last step."""
    import torch

    name = request.name
    batch = request.inputs["input_ids"].shape[0]
    cache = new_cache(model, REFERENCE_CACHE, request.inputs["input_ids"].shape[1] + steps)
    reset_decode_state(model)
    recorded: list[DecodeStep] = []
    with torch.no_grad():
        kwargs = prefill_kwargs(model, request.inputs, cache)
        output = model(**request.inputs, **kwargs)
        cache, logits = filled_cache(output, cache), output.logits[:, -1]
        prefill = {k: writer.put(f"{name}/decode/prefill/{k}", t)
                   for k, t in cache_state(cache).items()}  # fmt: skip
        inputs = dict(request.inputs)
        for number in range(1, steps + 1):
            token = logits.argmax(-1, keepdim=True)
            base = f"{name}/decode/{number}"
            calls: dict[str, list[dict[str, str]]] = {}

            def on_call(
                point: str,
                args: Any,
                kwargs: Any,
                output: Any,
                base: str = base,
                calls: dict[str, list[dict[str, str]]] = calls,
            ) -> None:
                outs = calls.setdefault(point, [])
                outs.append({
                    path: writer.put(f"{base}/{point}/{len(outs)}/{path}", t)
                    for path, t in step_outputs(output)
                    if new_token_output(t, batch)
                })  # fmt: skip

            inputs, forward = decode_inputs(model, inputs, token, cache)
            with hooks(model, point_names, on_call):
                logits = model(**forward).logits[:, -1]
            recorded.append(DecodeStep(writer.put(f"{base}/token", token),
                                       writer.put(f"{base}/logits", logits), calls))  # fmt: skip
            writer.release()
        final = {
            k: writer.put(f"{name}/decode/final/{k}", t) for k, t in cache_state(cache).items()
        }
    reset_decode_state(model)
    return Decode(REFERENCE_CACHE, recorded, prefill, final, cache_limits(model, request))


def limit_message(exc: BaseException) -> str:
    """The reference's own error as a limit's reason: its type and message on one line, at
    most ``LIMIT_CHARS``."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:LIMIT_CHARS]


def cache_family(implementation: str) -> str:
    """The cache whose limits ``implementation`` shares: ``static`` for the static caches,
    ``dynamic`` for the others."""
    return "static" if implementation.endswith("static") else "dynamic"


def cache_limits(model: Any, request: CaptureRequest) -> dict[str, str]:
    """For each of ``PROBED_CACHES`` the reference cannot decode ``request`` with, why: the
    error its forward raised (a prefill and one step, as the decode replay runs them), or
    the step's logits disagreeing with the reference cache's by more than
    ``tolerances.CACHE_LIMIT_DISAGREEMENT`` (GIT's static decode computes another result);
    building the cache for the model's config is part of the path (DeepSeek-V4's
    ``heavily_compressed_attention`` layers have no static layer class). A model that builds
    its own cache (``CacheUnsupported``) is left out: replay says so itself."""
    from numalign.golden.reference import CacheUnsupported

    limits: dict[str, str] = {}
    reference = _one_step(model, request, REFERENCE_CACHE)
    for implementation in PROBED_CACHES:
        try:
            logits = _one_step(model, request, implementation)
        except CacheUnsupported:
            continue
        except Exception as exc:  # the reference's own limit, kept with its message
            limits[implementation] = limit_message(exc)
            continue
        scale = float(reference.abs().max()) or 1.0
        apart = float((logits - reference).abs().max()) / scale
        if apart > CACHE_LIMIT_DISAGREEMENT:
            limits[implementation] = (
                f"its step's logits differ from the {REFERENCE_CACHE} cache's by {apart:.3g} of "
                f"their largest (more than {CACHE_LIMIT_DISAGREEMENT:g}): the model's code "
                "computes another result with this cache"
            )
    return limits


def _one_step(model: Any, request: CaptureRequest, implementation: str) -> Any:
    """The logits of one decode step after the prefill with a cache of ``implementation``."""
    import torch

    length = request.inputs["input_ids"].shape[1]
    cache = new_cache(model, implementation, length + 1)
    reset_decode_state(model)
    try:
        with torch.no_grad():
            output = model(**request.inputs, **prefill_kwargs(model, request.inputs, cache))
            cache = filled_cache(output, cache)
            token = output.logits[:, -1].argmax(-1, keepdim=True)
            _, forward = decode_inputs(model, dict(request.inputs), token, cache)
            return model(**forward).logits[:, -1].double()
    finally:
        reset_decode_state(model)


def step_outputs(output: Any) -> list[tuple[str, Any]]:
    """A capture point's tensor outputs at a decode step by path (``routing.point_tensors``),
    a router's routing, [tokens, experts] with one token per row at a step, laid out as the
    new token's [batch, 1, experts]: what capture stores, decode replay and calibration
    compare and decode localization runs again."""
    out = []
    for path, tensor in point_tensors(output):
        if path == ROUTING and tensor.dim() == 2:
            tensor = tensor[:, None]
        out.append((path, tensor))
    return out


def new_token_output(tensor: Any, batch: int) -> bool:
    """Whether a point's output is the new token's hidden states, laid out [batch, 1, hidden]:
    what a decode step compares. Attention weights (their key length depends on the cache
    implementation: a static cache pads them to its capacity), router logits (a router's
    routing is kept, laid out by ``step_outputs``) and integer outputs (GLM-DSA's top-k key
    indices, as many as the cache holds keys) are left out."""
    import torch

    return (
        isinstance(tensor, torch.Tensor)
        and tensor.is_floating_point()
        and tensor.dim() == 3
        and tensor.shape[0] == batch
        and tensor.shape[1] == 1
    )
