"""Top-k and sort, tie-aware: indices may differ only among exactly or nearly tied values."""

from __future__ import annotations

from typing import Any

import torch

from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, Output, candidate, register_operator
from operators._common import tier_cases

TOPK_CASES = tier_cases(
    Case("one-1x1-k1", {"rows": 1, "length": 1, "k": 1}),
    Case("rows-8x1000-k8", {"rows": 8, "length": 1000, "k": 8}),
    Case("ties-16x64-k5", {"rows": 16, "length": 64, "k": 5}, regime="ties"),
    Case("large-4x32000-k50", {"rows": 4, "length": 32000, "k": 50}, regime="large"),
    Case("all-3x17-k17", {"rows": 3, "length": 17, "k": 17}),
    Case("vocab-2x151936-k40", {"rows": 2, "length": 151936, "k": 40}, tier="pr"),
    Case("noncontig-5x77-k3", {"rows": 5, "length": 77, "k": 3, "noncontiguous": True}, tier="pr"),
    Case("long-1x1048576-k1024", {"rows": 1, "length": 1048576, "k": 1024}, tier="nightly"),
)


def topk_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    return {"x": values((case["rows"], case["length"]), case.regime, gen), "k": case["k"]}


def topk_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values in descending order, and their indices (lowest index first
    among ties, by a stable sort)."""
    order = torch.argsort(x, dim=-1, descending=True, stable=True)[..., :k]
    return x.gather(-1, order), order


register_operator(
    Operator(
        name="topk",
        aten=("topk",),
        op_class="selection",
        reference=topk_reference,
        make_inputs=topk_inputs,
        cases=TOPK_CASES,
        outputs=(Output("values"), Output("indices", kind="ties", ties_from="x")),
        description="k largest values and their indices (sampling, routing)",
    )
)


@candidate("topk", name="torch")
def topk_torch(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    result = torch.topk(x, k, dim=-1, largest=True, sorted=True)
    return result.values, result.indices


@candidate("topk", name="sort")
def topk_sort(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    result = torch.sort(x, dim=-1, descending=True)
    return result.values[..., :k], result.indices[..., :k]


SORT_CASES = tier_cases(
    Case("one-1x1", {"rows": 1, "length": 1}),
    Case("rows-4x1000", {"rows": 4, "length": 1000}),
    Case("ties-8x100", {"rows": 8, "length": 100}, regime="ties"),
    Case("unaligned-3x4099", {"rows": 3, "length": 4099}, tier="pr"),
    Case("long-1x131072", {"rows": 1, "length": 131072}, tier="pr"),
)


def sort_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    return {"x": values((case["rows"], case["length"]), case.regime, gen)}


def sort_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.argsort(x, dim=-1, stable=True)
    return x.gather(-1, order), order


register_operator(
    Operator(
        name="sort",
        aten=("sort",),
        op_class="selection",
        reference=sort_reference,
        make_inputs=sort_inputs,
        cases=SORT_CASES,
        outputs=(Output("values"), Output("indices", kind="ties", ties_from="x")),
        description="ascending sort with the permutation",
    )
)


@candidate("sort", name="torch")
def sort_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    result = torch.sort(x, dim=-1)
    return result.values, result.indices


@candidate("sort", name="argsort_gather")
def sort_argsort(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.argsort(x, dim=-1, descending=False)
    return x.gather(-1, order), order
