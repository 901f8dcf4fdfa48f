"""A capture's requests run through the reference with the capture points hooked: each
request's forward (every point's calls, the model's own outputs), its greedy continuation
and cached decode where it generates, then the probe calls; the tensors stream to the shard
writer and the manifest is filled as they run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from numalign.golden.capture_manifest import recorded_points
from numalign.golden.decode import record_decode
from numalign.golden.manifest import LOGIT_TRANSFORM, Continuation, Manifest, Request
from numalign.golden.nonfinite import refuse_nonfinite
from numalign.golden.probes import record_probes
from numalign.golden.progress import Progress
from numalign.golden.recorder import Recorder
from numalign.golden.reference import (
    append_token,
    forward_kwargs,
    greedy_step,
    hooks,
    model_outputs,
)
from numalign.golden.requests import CaptureRequest
from numalign.golden.shards import ShardWriter
from numalign.golden.statistics_info import STATISTICS_FORMAT, KeptWhole


def record_requests(
    model: Any,
    requests: Sequence[CaptureRequest],
    point_names: list[str],
    manifest: Manifest,
    writer: ShardWriter,
    bar: Progress,
    *,
    continuation: int,
    decode_steps: int,
    probes: bool = True,
    activations: bool = True,
    kept: KeptWhole | None = None,
) -> None:
    """Runs every request through the model with the points hooked, writing their tensors
    through ``writer`` and filling ``manifest`` (tensors, shards, decode steps of the requests
    that generate, and the points in forward order with their calls); then, with ``probes``,
    each probe of a point (``golden.probes``: a norm on rows at its epsilon, an activation on
    its gating tail, with ``activations`` a point of its own) as a call of the request
    ``probe``. ``kept``: which tensors are kept whole, the others as statistics only
    (``statistics_info.KeptWhole``; None: every one whole); a set that keeps some as
    statistics is written as format 5."""
    from numalign.golden.mask_points import MaskFunction

    recorder = Recorder(writer, mask_points=frozenset(
        n for n in point_names if isinstance(model.get_submodule(n), MaskFunction)),
        kept=kept or KeptWhole())  # fmt: skip
    for request in requests:
        bar.step(f"request {request.name}")
        _record_request(model, request, point_names, recorder, manifest, continuation)
        if request.generate and decode_steps > 0:
            manifest.decode[request.name] = record_decode(
                model, request, point_names, writer, decode_steps
            )
    recorder.mask = None
    recorded = {n: recorder.calls[n] for n in point_names if recorder.calls.get(n)}
    probed = record_probes(model, recorded, activations, recorder.on_call) if probes else []
    writer.flush()
    manifest.tensors, manifest.shards = dict(writer.tensors), dict(writer.shards)
    manifest.statistics = dict(writer.statistics)
    if manifest.statistics:
        manifest.format = STATISTICS_FORMAT
    manifest.points = recorded_points(model, [*point_names, *probed], recorder.calls,
                                      recorder.kinds)  # fmt: skip


def _record_request(
    model: Any,
    request: CaptureRequest,
    point_names: list[str],
    recorder: Recorder,
    manifest: Manifest,
    continuation: int,
) -> None:
    """One request's reference forward: every capture point's calls, the model's own outputs
    and, for language models, the greedy continuation; its tensors stream to the writer."""
    import torch

    writer, name = recorder.writer, request.name
    inputs = {k: writer.put(f"{name}/inputs/{k}", v) for k, v in request.inputs.items()}

    def on_call(point: str, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        recorder.on_call(name, point, args, kwargs, output)

    recorder.mask = request.inputs.get("attention_mask")
    transform = LOGIT_TRANSFORM in point_names
    with (
        torch.no_grad(),
        hooks(model, point_names, on_call),
        _head_output(model, transform) as head,
    ):
        finals = model_outputs(model(**request.inputs, **forward_kwargs(model)))
        if head:  # the forward does not call the logit transform: once here, on its input
            model.get_submodule(LOGIT_TRANSFORM)(head[-1])
        head.clear()
    refuse_nonfinite(recorder.nonfinite, name, finals, recorder.mask)
    if "logits" in finals:
        manifest.logits[name] = writer.put(f"{name}/logits", finals["logits"])
    else:
        manifest.outputs[name] = {k: writer.put(f"{name}/output/{k}", t)
                                  for k, t in finals.items()}  # fmt: skip
    del finals
    writer.release()
    if request.generate and continuation > 0 and name in manifest.logits:
        manifest.continuation[name] = _greedy(model, request, continuation, writer)
    manifest.requests.append(Request(name, inputs))


@contextmanager
def _head_output(model: Any, wanted: bool) -> Iterator[list[Any]]:
    """The LM head's outputs while the model runs (the logit transform's input), where the
    logit transform is a point (``wanted``); else nothing is hooked."""
    outputs: list[Any] = []
    if not wanted:
        yield outputs
        return
    head = model.get_submodule(model.get_submodule(LOGIT_TRANSFORM).head)
    handle = head.register_forward_hook(lambda module, args, output: outputs.append(output))
    try:
        yield outputs
    finally:
        handle.remove()


def _greedy(model: Any, request: CaptureRequest, steps: int, writer: ShardWriter) -> Continuation:
    """``steps`` greedy tokens, re-running the whole sequence each step (no cache), and the
    logits of each step."""
    import torch

    inputs = dict(request.inputs)
    tokens, step_logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            nxt, logits = greedy_step(model, inputs)
            tokens.append(nxt)
            step_logits.append(logits)
            inputs = append_token(inputs, nxt)
    return Continuation(
        tokens=writer.put(f"{request.name}/continuation/tokens", torch.cat(tokens, dim=1)),
        logits=writer.put(f"{request.name}/continuation/logits", torch.stack(step_logits, dim=1)),
    )
