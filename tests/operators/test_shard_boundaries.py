"""Shard boundaries in the case grid: every input that indexes a table of V rows (an
embedding's token ids, a loss's labels) holds the ids where tensor- and vocabulary-parallel
ranks split the table (``numalign.ops.cases.boundary_ids``), at every tier, smoke included.

A rank's range test off by one (``id <= end`` for ``id < end``) reads the boundary id from two
shards, and only that id: with ids drawn at random from a vocabulary of thousands, no case
met it. Planted here, for 2, 4 and 8 ranks, even and padded splits, in an embedding and in a
vocabulary-parallel cross-entropy; each fails at tier smoke, and the same kernels with the
range test right pass every smoke case in every dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from numalign.ops.cases import ID16_LIMIT, boundary_ids, generator, table_ids
from numalign.ops.check import check_operator
from numalign.ops.registry import OPERATORS, Candidate, load_catalogue

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHARDS = (2, 4, 8)


def _ranges(size: int, shards: int, padded: bool) -> list[tuple[int, int]]:
    """[start, end) of each rank: Megatron's padded split (ceil) or an even one (floor, the
    last rank takes the rest)."""
    per = -(-size // shards) if padded else size // shards
    starts = [r * per for r in range(shards)]
    return [(s, min(size, starts[r + 1]) if r + 1 < shards else size) for r, s in enumerate(starts)]


def _in_rank(ids: torch.Tensor, start: int, end: int, off_by_one: bool) -> torch.Tensor:
    return (ids >= start) & ((ids <= end) if off_by_one else (ids < end))


def sharded_embedding(shards: int, padded: bool, off_by_one: bool) -> Callable[..., torch.Tensor]:
    """A tensor-parallel embedding: each rank looks up the ids in its range (its local index
    read from the whole table, as a load past a shard's end reads the next shard's rows),
    zeros elsewhere, and the ranks' partial outputs are summed (the all-reduce)."""

    def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(ids.shape[0], table.shape[1], dtype=table.dtype)
        for start, end in _ranges(table.shape[0], shards, padded):
            mine = _in_rank(ids, start, end, off_by_one)
            rows = table[torch.where(mine, ids, 0).clamp_max(table.shape[0] - 1)]
            out = out + torch.where(mine[:, None], rows, 0.0)
        return out

    return embedding


def sharded_cross_entropy(
    shards: int, padded: bool, off_by_one: bool
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """A vocabulary-parallel cross-entropy (Megatron's): the logsumexp over all ranks, each
    rank's logit of the labels in its range, summed over ranks (the all-reduce)."""
    from operators.logits import IGNORE_INDEX

    def cross_entropy(logits: torch.Tensor, labels: torch.Tensor):
        lf = logits.float()
        counted = labels != IGNORE_INDEX
        picked = torch.zeros(lf.shape[0])
        for start, end in _ranges(lf.shape[-1], shards, padded):
            mine = counted & _in_rank(labels, start, end, off_by_one)
            local = torch.where(mine, labels, 0).clamp_max(lf.shape[-1] - 1)
            picked = picked + torch.where(mine, lf.gather(-1, local[:, None])[:, 0], 0.0)
        lse = torch.logsumexp(lf, -1) if lf.shape[-1] else torch.zeros(lf.shape[0])
        loss = torch.where(counted, lse - picked, 0.0)
        count = int(counted.sum())
        mean = loss.sum() / count if count else loss.sum() * 0.0
        return loss.to(logits.dtype), mean.to(logits.dtype)

    return cross_entropy


MAKERS = {"embedding": sharded_embedding, "cross_entropy": sharded_cross_entropy}


def _smoke_failures(operator: str, fn: Callable[..., object], dtypes=DTYPES) -> list[str]:
    """``fn`` run as a candidate of ``operator`` over its smoke cases: the failing ones."""
    load_catalogue()
    op = OPERATORS[operator]
    cand = Candidate(operator=operator, name="sharded", fn=fn, module=__name__)
    failed = []
    for case in (c for c in op.cases if c.runs_at("smoke")):
        for dtype in dtypes:
            results = check_operator(op, cand, case, dtype, torch.device("cpu"))
            failed += [f"{case.name} {dtype}: {r.reason}" for r in results if not r.passed]
    return failed


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "even"])
@pytest.mark.parametrize("shards", SHARDS)
@pytest.mark.parametrize("operator", sorted(MAKERS))
def test_a_rank_range_off_by_one_fails_at_tier_smoke(
    operator: str, shards: int, padded: bool
) -> None:
    failed = _smoke_failures(
        operator, MAKERS[operator](shards, padded, off_by_one=True), (torch.float32,)
    )
    assert failed, f"{operator} over {shards} ranks reading each boundary id twice passed"


@pytest.mark.parametrize("shards", SHARDS)
@pytest.mark.parametrize("operator", sorted(MAKERS))
def test_the_same_sharded_kernel_with_the_range_right_passes(operator: str, shards: int) -> None:
    for padded in (True, False):
        failed = _smoke_failures(operator, MAKERS[operator](shards, padded, off_by_one=False))
        assert not failed, "\n".join(failed)


@pytest.mark.parametrize("size", [1, 2, 50, 1000, 1031, 32000, 32001, 151936, 262144])
def test_boundary_ids_hold_every_rank_boundary_and_the_16_bit_limit(size: int) -> None:
    ids = boundary_ids(size)
    assert len(ids) == len(set(ids)) and all(0 <= i < size for i in ids)
    assert {0, size - 1} <= set(ids)
    for shards in SHARDS:
        for rank in range(1, shards):
            for start in (rank * (size // shards), rank * math.ceil(size / shards)):
                assert {start - 1, start} & set(range(size)) <= set(ids), (shards, rank, start)
    if size > ID16_LIMIT:
        assert {ID16_LIMIT - 1, ID16_LIMIT, ID16_LIMIT + 1} & set(range(size)) <= set(ids)
    else:
        assert max(ids) < ID16_LIMIT


def test_table_ids_put_the_boundaries_first_and_draw_the_rest_in_range() -> None:
    ids = table_ids(1000, 40, generator("shards"))
    assert ids.dtype == torch.int64 and ids.shape == (40,)
    assert ids[:16].tolist() == boundary_ids(1000)  # 16 boundaries of 1000 rows
    assert int(ids.min()) >= 0 and int(ids.max()) < 1000
    assert table_ids(1000, 3, generator("shards")).tolist() == boundary_ids(1000)[:3]


@pytest.mark.parametrize("operator", sorted(MAKERS))
def test_some_smoke_case_of_each_table_operator_holds_every_boundary(operator: str) -> None:
    """The mechanism reaches the operators: a smoke case whose ids hold all the boundaries of
    its table (the 16-bit limit included), so no boundary depends on the draw."""
    from numalign.ops.check import make_inputs

    load_catalogue()
    op = OPERATORS[operator]
    key, size = ("ids", "vocab") if operator == "embedding" else ("labels", "vocab")
    covered = []
    for case in (c for c in op.cases if c.runs_at("smoke") and c[size] > ID16_LIMIT):
        held = set(make_inputs(op, case)[key].tolist())
        covered.append(set(boundary_ids(case[size])) <= held)
    assert covered and all(covered)
