"""Bytes a capture and a replay take, part by part, from a model's ``Structure`` and the
capture's ``Workload``: weights, activations, KV cache, the golden set, the peaks unstreamed
and streamed, and the pipeline ranks a device's memory needs.

What is counted is a lower bound of the reference forward's largest tensors, as
``golden.long_bound`` counts them (eager attention's scores and probabilities, the MLP's
intermediates, the logits), plus what the plan adds: the keys and values expanded to every
query head, the residual stream and the KV cache where the forward keeps one. Allocator
overhead, temporary copies, the checkpoint's read buffers and the golden shard being
written are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from numalign.golden.statistics_info import KeptWhole
from numalign.plan.model import Part, Structure
from numalign.plan.workload import Request, Workload
from numalign.replay.pipeline_split import layout, split_layers

#: Bytes per value of the dtypes a plan names (the float8 formats: a checkpoint's dtype).
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
               "float8_e4m3fn": 1, "float8_e5m2": 1}  # fmt: skip
#: Share of a device's memory a plan leaves to the runtime (the CUDA/driver context, the
#: allocator's fragmentation, communication buffers): a rule of thumb, not a measurement;
#: weights and activations get the rest.
DEVICE_RESERVE = 0.10


def dtype_bytes(name: str) -> int:
    """Bytes per value of ``name``; ValueError naming the known dtypes otherwise."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {name!r}: give one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def experts_used(structure: Structure, workload: Workload) -> int:
    """Routed experts of one MoE layer the capture's requests reach at worst: every token
    of every forward picks ``top_k`` of them, so min(experts, tokens x top_k)."""
    s = structure.shapes
    return min(s.experts, workload.total_forward_tokens * max(1, s.top_k))


def streamed_params(part: Part, used: int) -> int:
    """Parameters a streamed run materializes of ``part``: all but the routed experts, and
    ``used`` of those (an MoE layer materializes only the experts the requests route to)."""
    if not part.moe:
        return part.params
    return (
        part.params
        - part.expert_params
        + part.expert_params * min(used, part.experts) // (part.experts or 1)
    )


def transient(structure: Structure, part: Part, r: Request, b: int) -> int:
    """The largest tensors ``part``'s forward holds at once for request ``r`` in a dtype of
    ``b`` bytes, besides its weights and the residual stream: a layer's eager attention
    (scores and probabilities, keys and values expanded to every head) or its MLP (three
    intermediates), whichever is larger; the head's logits (float32 at least); the
    embedding's output."""
    s, tokens = structure.shapes, r.rows * r.width
    if part.kind == "head":
        return tokens * s.vocab * max(b, 4)
    if part.kind != "layer":
        return tokens * s.hidden * b
    scores = 2 * r.rows * s.heads * r.width * r.width * b
    attention = scores + tokens * s.kv_expanded_values * b
    return max(attention, 3 * tokens * s.mlp_values(part.moe) * b)


def residual(structure: Structure, r: Request, b: int) -> int:
    """The hidden states between two layers for ``r`` (in and out: twice), and its mask."""
    return 2 * r.rows * r.width * structure.shapes.hidden * b + r.rows * r.width * r.width * b


def kv_cache(structure: Structure, part: Part, r: Request, w: Workload, b: int) -> int:
    """``part``'s KV cache for ``r`` at its largest (0 but for a layer of a generating
    request)."""
    if part.kind != "layer":
        return 0
    return r.rows * w.cache_length(r) * structure.shapes.kv_cache_values * b


def activations(structure: Structure, workload: Workload, b: int) -> int:
    """The worst request's activations in an unstreamed forward in a dtype of ``b`` bytes:
    its residual stream, the largest part's transient tensors, its KV cache of every layer."""
    parts = structure.parts
    return max(
        (
            residual(structure, r, b)
            + max(transient(structure, p, r, b) for p in parts)
            + sum(kv_cache(structure, p, r, workload, b) for p in parts)
            for r in workload.requests
        ),
        default=0,
    )


@dataclass(frozen=True)
class Peaks:
    """Peak bytes in one dtype. ``unstreamed``: every weight, with the worst request's
    activations and its KV cache of every layer. ``streamed``: the worst part alone, its
    weights (MoE: the routed experts used), its activations for the worst request, its KV
    cache for every request, and every request's residual stream (held between layers)."""

    dtype: str
    weights: int
    unstreamed: int
    streamed: int
    streamed_part: str


def peaks(structure: Structure, workload: Workload, dtype: str) -> Peaks:
    b, parts, reqs = dtype_bytes(dtype), structure.parts, workload.requests
    weights = sum(p.params for p in parts) * b
    worst = activations(structure, workload, b)
    used = experts_used(structure, workload)
    streams = sum(residual(structure, r, b) for r in reqs)

    def alone(p: Part) -> int:
        return (
            streamed_params(p, used) * b
            + max((transient(structure, p, r, b) for r in reqs), default=0)
            + sum(kv_cache(structure, p, r, workload, b) for r in reqs)
            + streams
        )

    top = max(parts, key=alone)
    return Peaks(dtype, weights, weights + worst, alone(top), top.name)


def golden_bytes(
    structure: Structure, workload: Workload, b: int = 4, kept: KeptWhole | None = None
) -> dict[str, int]:
    """A golden set's size in the reference dtype (``b`` bytes), by what holds it: every
    capture point's outputs for each recorded token (the prefill's and the decode steps'),
    the masks (one rows x width x width per request), the decode's two KV-cache snapshots
    and the continuation's last-position logits. Not counted: the probe calls, the
    calibration statistics (both small), inputs not shared with another point's output.
    ``kept`` (``numalign capture --full-points``): the prefill outputs of the points it does
    not keep whole are a sketch each (``statistics points``) instead."""
    s, w = structure.shapes, workload
    whole, sketches = _point_bytes(structure, w, b, kept or KeptWhole())
    kv = sum(kv_cache(structure, p, r, w, b) for p in structure.parts for r in w.requests)
    return {
        "capture points": whole,
        **({"statistics points": sketches} if kept is not None and kept.patterns else {}),
        "masks": sum(r.rows * r.width * r.width for r in w.requests) * b,
        "decode cache snapshots": 2 * kv,
        "continuation logits": sum(
            r.rows * w.continuation * s.vocab for r in w.requests if r.generates
        )
        * max(b, 4),
    }


def _point_bytes(structure: Structure, w: Workload, b: int, kept: KeptWhole) -> tuple[int, int]:
    """The capture points' outputs kept whole, and the sketches of those kept as statistics
    (one of ``kept.width`` float64 buckets per output and request; a decode step's one-token
    outputs stay whole, as do outputs no larger than twice the width). Parts from config
    arithmetic know no point names: a part is kept whole where its name matches."""
    recorded = sum(w.recorded_tokens(r) for r in w.requests)
    whole = sketches = 0
    for part in structure.parts:
        points = part.points or ((part.name, part.point_values),)
        for name, width in points:
            small = all(r.rows * r.width * width <= 2 * kept.width for r in w.requests)
            if kept.whole(name) or small:
                whole += recorded * width * b
                continue
            steps = sum(r.rows * w.decode_steps for r in w.requests if r.generates)
            whole += steps * width * b
            sketches += len(w.requests) * kept.width * 8
    return whole, sketches


def part_golden(part: Part, workload: Workload, b: int = 4) -> int:
    """``part``'s share of the capture points' outputs in a set."""
    return sum(workload.recorded_tokens(r) for r in workload.requests) * part.point_values * b


@dataclass(frozen=True)
class Pipeline:
    """Pipeline ranks for one dtype as ``--pp ranks`` splits the model: ``ranges`` holds each
    rank's contiguous parts (first, last), ``stage_bytes`` the weights each holds, ``layout``
    the decoder layers per rank as records name them (``0-30|31-60``); ``usable``: the bytes
    of weights one rank may hold; ``fits``: False where no split fits, not even one layer a
    rank (tensor parallel is then the way)."""

    dtype: str
    usable: int
    ranks: int
    ranges: tuple[tuple[str, str], ...]
    fits: bool
    stage_bytes: tuple[int, ...] = ()
    layout: str = ""


def pipeline(structure: Structure, workload: Workload, dtype: str, device: int) -> Pipeline:
    """The fewest pipeline ranks of ``device`` bytes each over which ``--pp`` splits the
    model's weights in ``dtype`` so that every rank's share fits: the decoder layers split
    as ``replay.pipeline_split.split_layers`` splits them (vLLM's split, the stages a deployment
    serves), rank 0 also holding the parts before the first layer (the embedding), the last
    rank those after the last (the final norm, the head). A rank's usable memory is the
    device's less ``DEVICE_RESERVE`` and the worst request's activations (``activations``:
    its KV cache of every layer included, an upper bound for a rank holding some of them)."""
    b = dtype_bytes(dtype)
    sizes = [p.params * b for p in structure.parts]
    usable = max(0, int(device * (1 - DEVICE_RESERVE)) - activations(structure, workload, b))
    layers = [i for i, p in enumerate(structure.parts) if p.kind == "layer"] or [0]
    names = [p.name for p in structure.parts]
    for ranks in range(max(1, math.ceil(sum(sizes) / max(usable, 1))), len(layers) + 1):
        runs = _stages(len(sizes), layers, ranks)
        held = tuple(sum(sizes[a : z + 1]) for a, z in runs)
        if max(held) <= usable:
            ranges = tuple((names[a], names[z]) for a, z in runs)
            return Pipeline(dtype, usable, ranks, ranges, True, held, layout(len(layers), ranks))
    return Pipeline(dtype, usable, 0, (), False)


def _stages(count: int, layers: list[int], ranks: int) -> list[tuple[int, int]]:
    """Each rank's parts (first, last index of ``count``) under ``--pp ranks``: its decoder
    layers (``layers``: their indices, in order), and every part from its first layer to the
    next rank's first: the first rank's from part 0, the last rank's to the last part."""
    starts = [0, *(layers[r.start] for r in split_layers(len(layers), ranks)[1:])]
    return list(zip(starts, [s - 1 for s in starts[1:]] + [count - 1], strict=True))
