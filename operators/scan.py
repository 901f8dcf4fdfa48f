"""Prefix sums (cumsum) and segment sums, accumulated in float32."""

from __future__ import annotations

from typing import Any

import torch

from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, candidate, register_operator
from operators._common import tier_cases, up
from operators._tiles import tiles, untile

CUMSUM_CASES = tier_cases(
    Case("one-1x1", {"rows": 1, "length": 1}),
    Case("rows-4x1000", {"rows": 4, "length": 1000}),
    Case("chunk-edges-3x129", {"rows": 3, "length": 129}),
    Case("large-2x4096", {"rows": 2, "length": 4096}, regime="large"),
    Case("unaligned-5x32769", {"rows": 5, "length": 32769}, tier="pr"),
    Case("noncontig-3x300", {"rows": 3, "length": 300, "noncontiguous": True}, tier="pr"),
    Case("empty-2x0", {"rows": 2, "length": 0}, tier="pr"),
    Case("long-1x131072", {"rows": 1, "length": 131072}),
    Case("long-8x1048576", {"rows": 8, "length": 1048576}, tier="nightly"),
)


def cumsum_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    return {"x": values((case["rows"], case["length"]), case.regime, gen)}


def cumsum_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(up(x), dim=-1).to(x.dtype)


register_operator(
    Operator(
        name="cumsum",
        aten=("cumsum",),
        op_class="scan",
        reference=cumsum_reference,
        make_inputs=cumsum_inputs,
        cases=CUMSUM_CASES,
        reduction_length=lambda case: case["length"],
        description="inclusive prefix sum along the last dim",
    )
)


@candidate("cumsum", name="torch")
def cumsum_torch(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, dim=-1, dtype=up(x).dtype).to(x.dtype)


#: Chunk of the two-level scan: a thread block's span on a GPU.
CHUNK = 64


@candidate("cumsum", name="chunked")
def cumsum_chunked(x: torch.Tensor) -> torch.Tensor:
    """Two-level scan: prefix sums inside chunks of 64, then a scan of the chunk totals
    added back as carries (the Blelloch-style layout of GPU scans)."""
    local = tiles(up(x), CHUNK).cumsum(-1)  # [..., chunks, CHUNK]
    carries = local[..., -1].cumsum(-1) - local[..., -1]
    return untile(local + carries[..., None], x.shape[-1]).to(x.dtype)


SEGMENT_CASES = tier_cases(
    Case("one-1x1-s1", {"rows": 1, "hidden": 1, "segments": 1}),
    Case("ragged-100x64-s7", {"rows": 100, "hidden": 64, "segments": 7}),
    Case("empty-segments-50x16-s20", {"rows": 50, "hidden": 16, "segments": 20, "gaps": True}),
    Case(
        "outliers-1000x128-s33",
        {"rows": 1000, "hidden": 128, "segments": 33},
        regime="outliers",
        tier="pr",
    ),
    Case("long-32768x64-s5", {"rows": 32768, "hidden": 64, "segments": 5}, tier="pr"),
    Case("long-262144x64-s17", {"rows": 262144, "hidden": 64, "segments": 17}, tier="nightly"),
)


def segment_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    rows, segments = case["rows"], case["segments"]
    ids = torch.randint(0, segments, (rows,), generator=gen).sort().values
    if case.get("gaps"):  # only even segment ids occur: odd segments are empty
        ids = (ids // 2) * 2
    return {
        "x": values((rows, case["hidden"]), case.regime, gen),
        "segment_ids": ids,
        "segments": segments,
    }


def segment_sum_reference(
    x: torch.Tensor, segment_ids: torch.Tensor, segments: int
) -> torch.Tensor:
    out = torch.zeros(segments, x.shape[1], dtype=up(x).dtype, device=x.device)
    return out.index_add_(0, segment_ids.to(x.device), up(x)).to(x.dtype)


register_operator(
    Operator(
        name="segment_sum",
        aten=("index_add", "scatter_add"),
        op_class="scan",
        reference=segment_sum_reference,
        make_inputs=segment_inputs,
        cases=SEGMENT_CASES,
        reduction_length=lambda case: max(1, case["rows"] // case["segments"]),
        description="sum of rows per sorted segment id (variable-length batches)",
    )
)


@candidate("segment_sum", name="scatter_reduce")
def segment_sum_scatter(x: torch.Tensor, segment_ids: torch.Tensor, segments: int) -> torch.Tensor:
    out = torch.zeros(segments, x.shape[1], dtype=up(x).dtype, device=x.device)
    index = segment_ids[:, None].expand(-1, x.shape[1])
    return out.scatter_reduce_(0, index, up(x), reduce="sum").to(x.dtype)


@candidate("segment_sum", name="boundaries")
def segment_sum_boundaries(
    x: torch.Tensor, segment_ids: torch.Tensor, segments: int
) -> torch.Tensor:
    """Sorted ids: each segment is a contiguous run; sum each run with torch.sum."""
    counts = torch.bincount(segment_ids, minlength=segments).tolist()
    out = torch.zeros(segments, x.shape[1], dtype=up(x).dtype, device=x.device)
    start = 0
    for seg, count in enumerate(counts):
        if count:
            out[seg] = up(x[start : start + count]).sum(0)
        start += count
    return out.to(x.dtype)
