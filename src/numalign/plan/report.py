"""A plan: what a capture and a replay of a model will take, before anything runs.

``plan(model_dir, ...)`` reads the model's config (``plan.model``: built on the meta device,
no weights), sizes the capture's requests (``plan.workload``), and returns a ``Plan`` whose
``data`` holds every figure (the JSON output, its fields in docs/plan.md) and whose
``to_text()`` renders them as tables.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from numalign.core.statistics import DEFAULT_WIDTH
from numalign.golden.statistics_info import KeptWhole
from numalign.plan import memory
from numalign.plan.measure import Throughput, measure
from numalign.plan.model import Part, Structure, structure
from numalign.plan.workload import Workload, capture_workload

#: What the golden-set estimate counts and leaves out (also in the JSON output).
GOLDEN_COUNTED = (
    "every default capture point's outputs (a layer, its norms, attention, MLP or MoE, "
    "router, experts: one hidden-size tensor each, a Linear its out_features) per recorded "
    "token, the masks, the decode's two KV-cache snapshots, the continuation's logits"
)
GOLDEN_NOT_COUNTED = (
    "probe calls and calibration statistics (small), inputs not shared with another point's "
    "output, safetensors headers"
)


@dataclass
class Plan:
    """Every figure of a plan (``data``: JSON-ready, sizes in bytes, times in seconds)."""

    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(self.data, indent=2) + "\n"

    def to_text(self) -> str:
        from numalign.plan.text import render

        return render(self.data)


def plan(
    model_dir: str | Path,
    *,
    dtypes: tuple[str, ...] = ("bfloat16",),
    reference_dtype: str = "float32",
    device_memory: int = 80 * 2**30,
    long: int | None = None,
    far: int = 8,
    max_position: int | None = None,
    continuation: int = 8,
    decode_steps: int = 4,
    trust_remote_code: bool = False,
    throughput: Throughput | None = None,
    measured: bool = True,
    full_points: tuple[str, ...] | None = None,
    sketch_width: int = DEFAULT_WIDTH,
) -> Plan:
    """The plan of the model in ``model_dir`` (its config.json alone is read) for a capture
    with these options (``numalign capture``'s, same defaults; ``full_points``: its
    ``--full-points``, the golden set's other points kept as sketches of ``sketch_width``) in
    ``reference_dtype`` and a replay in each of ``dtypes`` on devices of ``device_memory``
    bytes. ``throughput``: this machine's (None and ``measured``: measured now; None
    otherwise: no time estimate)."""
    folder = Path(model_dir)
    for name in (reference_dtype, *dtypes):
        memory.dtype_bytes(name)
    found = structure(folder, trust_remote_code=trust_remote_code)
    work = capture_workload(
        folder, long=long, far=far, max_position=max_position, continuation=continuation,
        decode_steps=decode_steps, trust_remote_code=trust_remote_code,
    )  # fmt: skip
    if throughput is None and measured:
        throughput = measure()
    names = tuple(dict.fromkeys((reference_dtype, *dtypes)))
    data: dict[str, Any] = {
        "model": folder.name,
        "model_dir": str(folder),
        "model_type": found.model_type,
        "architecture": found.architecture,
        "built": found.built,
        "build_s": round(found.build_s, 3),
        "reference_dtype": reference_dtype,
        "dtypes": list(dtypes),
        "params": found.params,
        "expert_params": sum(p.expert_params for p in found.parts),
        "active_params": active_params(found),
        "experts_used": memory.experts_used(found, work),
        "parts": [_row(found, work, group, names) for group in groups(found.parts)],
        "totals": _totals(found, work, names),
        **_requests(work),
        "capture_refuses": _refused(
            folder, long, max(continuation, decode_steps), reference_dtype, trust_remote_code
        ),
        "golden": golden_estimate(
            found,
            work,
            b=memory.dtype_bytes(reference_dtype),
            kept=KeptWhole.of(full_points, sketch_width),
        ),
        "peaks": {n: _peaks(found, work, n) for n in names},
        "device_memory": device_memory,
        "pipeline": {n: _pipeline(found, work, n, device_memory) for n in names},
        "tensor_parallel": tensor_parallel(found, work, names, device_memory),
        "throughput": None,
        "time": _time(found, work, throughput),
    }
    if throughput is not None:
        data["throughput"] = {"matmul_flops_s": throughput.flops,
                              "read_bytes_s": throughput.read_bytes_s,
                              "read_note": throughput.read_note}  # fmt: skip
    return Plan(data)


def groups(parts: tuple[Part, ...]) -> list[list[Part]]:
    """``parts`` with consecutive decoder layers of the same signature in one group."""
    found: list[list[Part]] = []
    for part in parts:
        last = found[-1][-1] if found else None
        same = last is not None and part.kind == last.kind == "layer"
        if same and last is not None and part.signature == last.signature:
            found[-1].append(part)
            continue
        found.append([part])
    return found


def group_name(group: list[Part]) -> str:
    """``layers 3-60 (58x)`` for a group of layers, the part's name for one part."""
    if len(group) == 1:
        return group[0].name
    first, last = group[0].name.split()[-1], group[-1].name.split()[-1]
    return f"layers {first}-{last} ({len(group)}x)"


def active_params(found: Structure) -> int:
    """Parameters one token's forward multiplies by: all but the embedding (a lookup), with
    ``top_k`` of each MoE layer's routed experts."""
    k, total = found.shapes.top_k, 0
    for p in found.parts:
        if p.kind != "embedding":
            total += p.params - p.expert_params + p.expert_params * k // (p.experts or 1)
    return total


def _row(
    found: Structure, work: Workload, group: list[Part], names: tuple[str, ...]
) -> dict[str, Any]:
    """One table row (a group's figures are each layer's: the group's are ``count`` times)."""
    p, used = group[0], memory.experts_used(found, work)
    row: dict[str, Any] = {"name": group_name(group), "first": p.name, "last": group[-1].name,
                           "count": len(group), "kind": p.kind, "params": p.params,
                           "expert_params": p.expert_params, "experts": p.experts,
                           "experts_used": min(used, p.experts)}  # fmt: skip
    for n in names:
        b = memory.dtype_bytes(n)
        row.setdefault("weight_bytes", {})[n] = p.params * b
        row.setdefault("streamed_weight_bytes", {})[n] = memory.streamed_params(p, used) * b
        row.setdefault("activation_bytes", {})[n] = max(
            (memory.transient(found, p, r, b) for r in work.requests), default=0
        )
        row.setdefault("kv_cache_bytes", {})[n] = sum(
            memory.kv_cache(found, p, r, work, b) for r in work.requests
        )
    row["golden_bytes"] = memory.part_golden(p, work, memory.dtype_bytes(names[0]))
    return row


def _totals(found: Structure, work: Workload, names: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"weight_bytes": {}, "kv_cache_bytes": {}}
    for n in names:
        b = memory.dtype_bytes(n)
        out["weight_bytes"][n] = found.params * b
        out["kv_cache_bytes"][n] = sum(
            memory.kv_cache(found, p, r, work, b) for p in found.parts for r in work.requests
        )
    return out


def _refused(
    folder: Path, long: int | None, generated: int, reference_dtype: str, trust: bool
) -> str | None:
    """Why ``numalign capture`` with these options would refuse the model's long requests
    before loading it (``golden.long_bound``: past the model's positions; this machine's
    memory is not the plan's to judge), None where it would not: the figures above are then
    the arithmetic of requests the model cannot take."""
    from numalign.golden.long_bound import LongRequestError, check_long_request

    try:
        check_long_request(folder, long, generated, reference_dtype, "sdpa", trust,
                           in_memory=False)  # fmt: skip
    except LongRequestError as exc:
        return str(exc)
    return None


def _requests(work: Workload) -> dict[str, Any]:
    return {
        "requests": [
            {
                "name": r.name,
                "rows": r.rows,
                "width": r.width,
                "generates": r.generates,
                "forward_tokens": work.forward_tokens(r),
            }
            for r in work.requests
        ],
        "continuation": work.continuation,
        "decode_steps": work.decode_steps,
        "forward_tokens": work.total_forward_tokens,
    }


def golden_estimate(found: Structure, work: Workload, b: int, kept: KeptWhole) -> dict[str, Any]:
    """The golden set's size: in ``bytes``, by what holds it, and where ``kept`` keeps some
    points as statistics only, what the set would take whole (``whole_bytes``) and the
    patterns kept whole (``full_points``)."""
    parts = memory.golden_bytes(found, work, b, kept)
    out = {"bytes": sum(parts.values()), "by": parts, "counted": GOLDEN_COUNTED,
           "not_counted": GOLDEN_NOT_COUNTED}  # fmt: skip
    if kept.patterns is not None:
        out["whole_bytes"] = sum(memory.golden_bytes(found, work, b).values())
        out["full_points"] = list(kept.patterns)
        out["sketch_width"] = kept.width
    return out


def _peaks(found: Structure, work: Workload, dtype: str) -> dict[str, Any]:
    p = memory.peaks(found, work, dtype)
    return {"unstreamed": p.unstreamed, "streamed": p.streamed, "streamed_part": p.streamed_part}


def _pipeline(found: Structure, work: Workload, dtype: str, device: int) -> dict[str, Any]:
    p = memory.pipeline(found, work, dtype, device)
    return {"ranks": p.ranks, "usable_bytes": p.usable, "fits": p.fits,
            "ranges": [list(r) for r in p.ranges], "stage_bytes": list(p.stage_bytes),
            "layout": p.layout}  # fmt: skip


def tensor_parallel(
    found: Structure, work: Workload, names: tuple[str, ...], device: int
) -> dict[str, int]:
    """Per dtype, the tensor-parallel ranks that hold the weights instead: every layer split
    over N ranks (transformers' tp_plan, ``--tp N``), N the smallest divisor of the attention
    heads with weights / N within one device's usable memory (0: none is enough)."""
    heads = found.shapes.heads or 1
    out: dict[str, int] = {}
    for n in names:
        b = memory.dtype_bytes(n)
        usable = int(device * (1 - memory.DEVICE_RESERVE)) - memory.activations(found, work, b)
        need = math.ceil(found.params * b / usable) if usable > 0 else heads + 1
        out[n] = next((d for d in range(max(1, need), heads + 1) if heads % d == 0), 0)
    return out


def _time(found: Structure, work: Workload, throughput: Throughput | None) -> dict[str, Any]:
    """One reference pass: 2 x active parameters x forward tokens FLOPs at the measured
    matmul rate, plus reading the checkpoint once (in its published dtype) at the measured
    read rate. Calibration's ensemble reruns the requests per member and dtype."""
    flops = 2 * active_params(found) * work.total_forward_tokens
    dtype = found.shapes.checkpoint_dtype
    read = found.params * memory.DTYPE_BYTES.get(dtype, 4)
    out: dict[str, Any] = {"flops": flops, "checkpoint_dtype": dtype, "read_bytes": read,
                           "compute_s": None, "read_s": None, "total_s": None}  # fmt: skip
    if throughput is not None:
        out["compute_s"] = flops / throughput.flops
        out["read_s"] = read / throughput.read_bytes_s
        out["total_s"] = out["compute_s"] + out["read_s"]
    return out
