"""Sampling from logits: temperature, top-k, top-p (nucleus) and one draw per row.

The operator's contract (that of transformers' TemperatureLogitsWarper, TopKLogitsWarper
and TopPLogitsWarper in that order, then one draw), stated so that ties do not matter:

- probabilities are softmax(logits / temperature) in float32;
- top-k keeps the k most probable tokens (``top_k = 0``: every token), which of several
  tied tokens at the boundary is free;
- top-p keeps the least number m of those, most probable first, whose mass reaches
  ``top_p`` (``top_p = 1``: all of them), and renormalizes the kept mass to 1;
- the draw is the inverse CDF of the uniform ``u`` over the kept tokens, most probable
  first: the first position whose cumulative probability exceeds ``u``.

Whether a token whose preceding mass lies within the cumulative sum's rounding of ``top_p``
is kept is free too (``nucleus_boundary``): ``probs`` is compared without those positions.

Outputs are in descending order of probability, so tied tokens are interchangeable:
``order`` [rows, K] (the K = top_k or vocab most probable token ids, compared tie-aware
against the logits), ``probs`` [rows, K] (the renormalized probabilities in that order,
zeros past m) and ``ids`` [rows, 1] (the sampled token, tie-aware). The randomness is an
input: ``u`` is drawn from the case's seeded generator in the middle of a step of the CDF of
one of the two most probable tokens, so that the id is decided by probabilities that agree
far beyond rounding (a draw on the edge of a step is a coin toss between honest kernels)."""

from __future__ import annotations

import math
from typing import Any

import torch

from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, Output, candidate, register_operator
from operators._common import tier_cases, up


def _case(
    name: str,
    rows: int,
    vocab: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    regime: str = "ordinary",
    tier: str = "smoke",
    **options: Any,
) -> Case:
    params = {"rows": rows, "vocab": vocab, "temperature": temperature, "top_k": top_k}
    return Case(name, params | {"top_p": top_p} | options, regime=regime, tier=tier)


SAMPLING_CASES = tier_cases(
    _case("one-1x1", 1, 1),
    _case("typical-4x32000-t0.7-k50-p0.9", 4, 32000, temperature=0.7, top_k=50, top_p=0.9),
    # top_p off the masses tie levels sum to (0.8 would equal four of five tied tokens exactly,
    # where rounding alone decides the cut)
    _case("ties-8x64-k5-p0.77", 8, 64, top_k=5, top_p=0.77, regime="ties"),
    _case("large-3x32001-k40-p0.95", 3, 32001, top_k=40, top_p=0.95, regime="large"),
    _case("topk-only-5x4096-k20", 5, 4096, temperature=1.3, top_k=20),
    _case("topp-only-2x151936-p0.9", 2, 151936, temperature=0.8, top_p=0.9, tier="pr"),
    _case("temperature-3x32001-t0.5", 3, 32001, temperature=0.5, tier="pr"),
    _case("noncontig-6x1031-k10-p0.7", 6, 1031, top_k=10, top_p=0.7, tier="pr", noncontiguous=True),
    _case("empty-0x32000-k50", 0, 32000, top_k=50, top_p=0.9, tier="pr"),
    _case("many-256x151936-k50-p0.95", 256, 151936, top_k=50, top_p=0.95, tier="nightly"),
)


def _masses(
    logits: torch.Tensor, temperature: float, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the top-k probabilities [rows, K] in descending order, renormalized over the k;
    their token ids; the mass of the more probable tokens before each), in the accumulation
    dtype. Ties: stable."""
    lf = up(logits)
    width = top_k if 0 < top_k < lf.shape[-1] else lf.shape[-1]
    probs = torch.softmax(lf / temperature, dim=-1) if lf.shape[-1] else lf
    order = torch.argsort(probs, dim=-1, descending=True, stable=True)[..., :width]
    top = probs.gather(-1, order)
    # top-k renormalizes before top-p measures mass, as the warpers' softmax of the
    # remaining logits does
    top = top / top.sum(-1, keepdim=True).clamp_min(torch.finfo(top.dtype).tiny)
    return top, order, top.cumsum(-1) - top


#: Standard deviations of the float32 cumulative sum's rounding walk within which a token's
#: preceding mass is too close to top_p for rounding to decide whether it is kept: each of the
#: K partial sums rounds by up to 2**-24 (the sum is below 1), so the walk's deviation is
#: sqrt(K) * 2**-24; four of them cover all but 6e-5 of the honest orders.
BOUNDARY_WALKS = 4.0


def nucleus_boundary(inputs: Any, case: Case) -> torch.Tensor:
    """The ``probs`` positions [rows, K] whose top-p membership rounding decides: the
    tokens whose preceding mass lies within ``BOUNDARY_WALKS`` deviations of the float32
    cumulative sum's rounding walk of top_p (past the first token, which is always kept).
    In a flat distribution over a large vocabulary the tokens at the cut weigh less than the
    sum's rounding, so honest kernels keep one or two more or fewer of them."""
    top, _, before = _masses(inputs["logits"].double(), case["temperature"], case["top_k"])
    if case["top_p"] >= 1.0 or top.shape[-1] == 0:
        return torch.zeros_like(top, dtype=torch.bool)
    band = BOUNDARY_WALKS * math.sqrt(top.shape[-1]) * 2.0**-24
    undecided = (before - case["top_p"]).abs() <= band
    undecided[..., :1] = False
    return undecided


def _kept_sorted(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities [rows, K] in descending order, renormalized over the top-p prefix and
    zero past it; their token ids [rows, K]), in the accumulation dtype. Ties: stable."""
    top, order, before = _masses(logits, temperature, top_k)
    kept = before < top_p
    kept[..., :1] = True
    top = torch.where(kept, top, 0.0)
    return top / top.sum(-1, keepdim=True).clamp_min(torch.finfo(top.dtype).tiny), order


def _draw(probs: torch.Tensor, order: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first position whose cumulative probability exceeds u, as a token id [rows, 1]."""
    cdf = probs.cumsum(-1)
    position = (cdf <= up(u).to(cdf.device)[:, None]).sum(-1, keepdim=True)
    last = (probs > 0).sum(-1, keepdim=True) - 1  # u beyond the rounded total: the last kept
    return order.gather(-1, torch.minimum(position, last.clamp_min(0)))


def sampling_reference(
    logits: torch.Tensor, u: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [rows, vocab], u [rows] in [0, 1) -> (order [rows, K] int64, probs [rows, K] in
    the logits' dtype, ids [rows, 1] int64); K = top_k, or vocab without top-k."""
    probs, order = _kept_sorted(logits, temperature, top_k, top_p)
    if logits.shape[0] == 0:
        return order, probs.to(logits.dtype), order[:, :1]
    return order, probs.to(logits.dtype), _draw(probs, order, u)


def sampling_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """logits [rows, vocab] and u [rows]: the middle of the CDF step of the most probable
    token, or of the second where its step is at least a fifth of the first's (per row, at
    random), computed on these float64 logits; rounding the logits to a 16-bit dtype moves
    each step by a few percent of its width at most."""
    rows, vocab = case["rows"], case["vocab"]
    logits = values((rows, vocab), case.regime, gen)
    t, k, p = case["temperature"], case["top_k"], case["top_p"]
    probs, _ = _kept_sorted(logits, t, k, p)
    second = torch.rand(rows, generator=gen, dtype=torch.float64) < 0.5
    if vocab > 1:
        second &= probs[:, 1] >= 0.2 * probs[:, 0]
    else:
        second &= False
    first = probs[:, 0] if vocab else torch.zeros(rows, dtype=torch.float64)
    u = torch.where(second, first + probs[:, 1] / 2 if vocab > 1 else first, first / 2)
    return {"logits": logits, "u": u, "temperature": t, "top_k": k, "top_p": p}


register_operator(
    Operator(
        name="sampling",
        aten=("multinomial",),
        op_class="softmax",
        reference=sampling_reference,
        make_inputs=sampling_inputs,
        cases=SAMPLING_CASES,
        outputs=(
            Output("order", kind="ties", ties_from="logits"),
            Output("probs", undecided=nucleus_boundary),
            Output("ids", kind="ties", ties_from="logits"),
        ),
        reduction_length=lambda case: case["vocab"],
        hf_modules=("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"),
        description="temperature, top-k, top-p, renormalization and one inverse-CDF draw",
    )
)


@candidate("sampling", name="sort")
def sampling_sort(
    logits: torch.Tensor, u: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' way: scaled logits, one full descending sort, masks, softmax again."""
    lf = up(logits) / temperature
    sorted_logits, order = torch.sort(lf, dim=-1, descending=True)
    if 0 < top_k < lf.shape[-1]:
        sorted_logits, order = sorted_logits[..., :top_k], order[..., :top_k]
    probs = torch.softmax(sorted_logits, dim=-1)
    cut = (probs.cumsum(-1) - probs) >= top_p
    cut[..., :1] = False
    probs = torch.softmax(sorted_logits.masked_fill(cut, float("-inf")), dim=-1)
    if logits.shape[0] == 0:
        return order, probs.to(logits.dtype), order[:, :1]
    return order, probs.to(logits.dtype), _draw(probs, order, u)


@candidate("sampling", name="topk_first")
def sampling_topk_first(
    logits: torch.Tensor, u: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.topk over the raw logits (temperature > 0 keeps the order), then the softmax of
    only the k survivors: no full-vocabulary sort where top-k is set."""
    lf = up(logits)
    width = top_k if 0 < top_k < lf.shape[-1] else lf.shape[-1]
    top, order = torch.topk(lf, width, dim=-1, largest=True, sorted=True)
    probs = torch.softmax(top / temperature, dim=-1)
    keep = torch.cumsum(probs, dim=-1) - probs < top_p
    keep[..., :1] = True
    probs = probs * keep
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
    if logits.shape[0] == 0:
        return order, probs.to(logits.dtype), order[:, :1]
    return order, probs.to(logits.dtype), _draw(probs, order, u)
