"""Paged KV cache: writing keys into fixed-size pages through a slot mapping, gathering them
back through a block table, and decode attention over the paged cache (vLLM's layout)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, candidate, register_operator
from operators._common import tier_cases, up

#: Page sizes of the built-in candidates: vLLM's default and a large one.
PAGE_SIZES = (16, 64)

PAGED_CASES = tier_cases(
    Case("one-1x1x1x8", {"lengths": (1,), "kv_heads": 1, "q_heads": 1, "dim": 8}),
    Case(
        "boundaries-6x4x8x64",
        {"lengths": (15, 16, 17, 63, 64, 65), "kv_heads": 4, "q_heads": 8, "dim": 64},
    ),
    Case("ragged-3x2x8x128", {"lengths": (1, 200, 129), "kv_heads": 2, "q_heads": 8, "dim": 128}),
    Case(
        "large-2x2x4x64",
        {"lengths": (100, 37), "kv_heads": 2, "q_heads": 4, "dim": 64},
        regime="large",
    ),
    Case(
        "llm-4x8x32x128",
        {"lengths": (1024, 1, 513, 65), "kv_heads": 8, "q_heads": 32, "dim": 128},
        tier="pr",
    ),
    Case(
        "long-1x2x16x128",
        {"lengths": (32768,), "kv_heads": 2, "q_heads": 16, "dim": 128},
        tier="nightly",
    ),
)


def paged_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    lengths = torch.tensor(case["lengths"], dtype=torch.int64)
    b, s = len(lengths), int(lengths.max())
    h, d = case["kv_heads"], case["dim"]
    return {
        "q": values((b, case["q_heads"], d), case.regime, gen),
        "k": values((b, s, h, d), "ordinary", gen),
        "v": values((b, s, h, d), "ordinary", gen),
        "lengths": lengths,
    }


def _valid(lengths: torch.Tensor, s: int) -> torch.Tensor:
    return torch.arange(s, device=lengths.device)[None, :] < lengths[:, None]


def kv_gather_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """The keys each sequence holds, zeros past its length: what a gather must return."""
    valid = _valid(lengths.to(k.device), k.shape[1])
    return torch.where(valid[:, :, None, None], k, torch.zeros_like(k))


def paged_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Decode attention: one query per sequence over its first ``lengths[b]`` keys."""
    group = q.shape[1] // k.shape[2]
    kf = up(k).repeat_interleave(group, 2)  # [b, s, hq, d]
    vf = up(v).repeat_interleave(group, 2)
    scores = torch.einsum("bhd,bshd->bhs", up(q), kf) * q.shape[-1] ** -0.5
    valid = _valid(lengths.to(q.device), k.shape[1])[:, None, :]
    probs = torch.softmax(scores.masked_fill(~valid, -math.inf), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhs,bshd->bhd", probs, vf).to(q.dtype)


register_operator(
    Operator(
        name="paged_kv_gather",
        op_class="gather-scatter",
        reference=kv_gather_reference,
        make_inputs=paged_inputs,
        cases=PAGED_CASES,
        description="write K into pages by slot mapping, gather back by block table",
    )
)
register_operator(
    Operator(
        name="paged_attention",
        op_class="attention",
        reference=paged_attention_reference,
        make_inputs=paged_inputs,
        cases=PAGED_CASES,
        reduction_length=lambda case: max(case["lengths"]),
        description="decode attention over a paged KV cache",
    )
)


class PagedCache:
    """A pool of pages ``[pages, page_size, heads, dim]`` and a block table per sequence.

    Pages are handed out in a shuffled order (seeded), so that a gather that ignores the
    block table fails."""

    def __init__(
        self,
        lengths: torch.Tensor,
        page_size: int,
        heads: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.page_size = page_size
        self.lengths = lengths.to(device)
        per_seq = [math.ceil(int(n) / page_size) for n in lengths]
        total = sum(per_seq) + 1  # one spare page, never referenced
        order = torch.randperm(total, generator=torch.Generator().manual_seed(page_size))
        self.table = torch.full((len(per_seq), max(per_seq)), -1, dtype=torch.int64)
        used = 0
        for seq, count in enumerate(per_seq):
            self.table[seq, :count] = order[used : used + count]
            used += count
        self.table = self.table.to(device)
        self.pool = torch.zeros(total, page_size, heads, dim, dtype=dtype, device=device)

    def slots(self, seq: int, count: int) -> torch.Tensor:
        """Flat slot ids (page * page_size + offset) of the first ``count`` tokens."""
        pos = torch.arange(count, device=self.table.device)
        return self.table[seq, pos // self.page_size] * self.page_size + pos % self.page_size

    def write(self, seq: int, keys: torch.Tensor) -> None:
        flat = self.pool.view(-1, *self.pool.shape[2:])
        flat.index_copy_(0, self.slots(seq, keys.shape[0]), keys)

    def gather(self, seq: int, count: int) -> torch.Tensor:
        return self.pool.view(-1, *self.pool.shape[2:])[self.slots(seq, count)]


def _fill(k: torch.Tensor, lengths: torch.Tensor, page_size: int) -> PagedCache:
    cache = PagedCache(lengths.cpu(), page_size, k.shape[2], k.shape[3], k.dtype, k.device)
    for seq, n in enumerate(lengths.tolist()):
        cache.write(seq, k[seq, :n])
    return cache


def _gather_candidate(page_size: int) -> Callable[..., torch.Tensor]:
    def gather(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        cache = _fill(k, lengths, page_size)
        out = torch.zeros_like(k)
        for seq, n in enumerate(lengths.tolist()):
            out[seq, :n] = cache.gather(seq, n)
        return out

    return gather


def _attention_candidate(page_size: int) -> Callable[..., torch.Tensor]:
    def paged_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Page by page with an online softmax in float32 (vLLM's paged attention v1)."""
        kc, vc = _fill(k, lengths, page_size), _fill(v, lengths, page_size)
        group = q.shape[1] // k.shape[2]
        out = torch.zeros(q.shape, dtype=up(q).dtype, device=q.device)
        for seq, n in enumerate(lengths.tolist()):
            qs = up(q[seq]) * q.shape[-1] ** -0.5  # [hq, d]
            run_max = torch.full((q.shape[1], 1), -math.inf, dtype=qs.dtype, device=q.device)
            run_sum = torch.zeros_like(run_max)
            acc = torch.zeros_like(qs)
            for start in range(0, n, page_size):
                count = min(page_size, n - start)
                page = kc.table[seq, start // page_size]
                kp = up(kc.pool[page, :count]).repeat_interleave(group, 1)  # [count, hq, d]
                vp = up(vc.pool[page, :count]).repeat_interleave(group, 1)
                scores = torch.einsum("hd,chd->hc", qs, kp)
                new_max = torch.maximum(run_max, scores.amax(-1, keepdim=True))
                correction = torch.exp(run_max - new_max)
                p = torch.exp(scores - new_max)
                run_sum = run_sum * correction + p.sum(-1, keepdim=True)
                acc = acc * correction + torch.einsum("hc,chd->hd", p, vp)
                run_max = new_max
            out[seq] = torch.where(run_sum > 0, acc / run_sum.clamp_min(1e-30), 0.0)
        return out.to(q.dtype)

    return paged_attention


for _size in PAGE_SIZES:
    candidate("paged_kv_gather", name=f"pages{_size}")(_gather_candidate(_size))
    candidate("paged_attention", name=f"pages{_size}")(_attention_candidate(_size))
