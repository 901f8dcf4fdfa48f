"""The tiles behind the catalogue's tiled candidates (``operators._tiles``): exact cutting and
padding, a split softmax equal to the plain one, and the reason they exist: a tiled candidate
compiles once for every length instead of once per length (the loops they replace made
``--compile`` unroll a tile loop per case, tens of seconds each).

Compilation is counted with Dynamo's ``eager`` machinery (tracing only, no code generation):
what is tested is how many graphs Dynamo makes, which every backend shares."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from numalign.ops.cases import Case
from numalign.ops.registry import OPERATORS, candidates, load_catalogue
from numalign.runtime.compiled import CompileSpec, compiled_function
from operators._tiles import split_softmax, tiles, untile

load_catalogue()


@pytest.mark.parametrize("length", [0, 1, 63, 64, 65, 200])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_tiles_pad_the_last_tile_and_untile_restores_the_tensor(length: int, dim: int) -> None:
    shape = [3, 5, 7]
    shape[dim] = length
    x = torch.randn(shape)
    cut = tiles(x, 64, dim=dim, fill=-1.5)
    n = math.ceil(length / 64)
    at = dim % x.dim()
    assert cut.shape == (*shape[:at], n, 64, *shape[at + 1 :])
    assert torch.equal(untile(cut, length, dim=at), x)
    padding = cut.movedim((at, at + 1), (0, 1)).flatten(0, 1)[length:]
    assert bool((padding == -1.5).all())


def test_tiles_of_a_mask_pad_with_false() -> None:
    mask = torch.ones(2, 70, dtype=torch.bool)
    cut = tiles(mask, 64, fill=False)
    assert cut.dtype == torch.bool
    assert int(cut.sum()) == 140  # every real entry, no padding entry


def _masked_scores(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    scores = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 8
    mask = torch.rand(rows, cols, generator=gen) < 0.3
    mask[0] = True  # a fully masked row
    mask[1, :64] = True  # a fully masked first tile
    return scores.masked_fill(mask, -math.inf)


@pytest.mark.parametrize("cols", [1, 64, 130, 1000])
def test_split_softmax_is_the_softmax_and_the_logsumexp(cols: int) -> None:
    scores = _masked_scores(4, cols, torch.Generator().manual_seed(cols))
    weights, total, peak = split_softmax(scores, 64)
    probs = torch.where(total > 0, weights / total.clamp_min(1e-300), 0.0)
    expected = torch.softmax(scores, -1).nan_to_num(0.0)  # the fully masked row: zeros
    # float64 throughout: a different summation order leaves rounding of ~1e-16 per term
    torch.testing.assert_close(probs, expected, rtol=1e-12, atol=1e-14)
    assert total[0].item() == 0.0 and peak[0].item() == 0.0
    finite = total[:, 0] > 0
    torch.testing.assert_close(
        (peak + torch.log(total))[finite, 0], torch.logsumexp(scores, -1)[finite], rtol=1e-12,
        atol=0.0,
    )  # fmt: skip


def test_split_softmax_with_a_sink_and_rounded_probabilities() -> None:
    gen = torch.Generator().manual_seed(0)
    scores = _masked_scores(4, 300, gen).float()
    sink = torch.tensor([[2.0], [-1.0], [40.0], [0.5]])
    weights, total, _ = split_softmax(scores, 64, sink=sink, p_dtype=torch.bfloat16)
    with_sink = torch.softmax(torch.cat([scores, sink], -1), -1)[:, :-1]
    # p rounded to bfloat16 (relative error 2^-9 per weight) before it is rescaled
    torch.testing.assert_close(weights / total, with_sink, rtol=2**-8, atol=1e-7)
    assert bool((weights[0] == 0).all()) and bool(total[0] > 0)  # masked row: only the sink


def _case_with(operator: str, base: str, **params: Any) -> Case:
    case = next(c for c in OPERATORS[operator].cases if c.name == base)
    return Case(f"{base}-with-{params}", {**case.params, **params}, case.regime, case.tier)


#: (operator, candidate, a case of its grid, the length parameter its tiles cut, lengths).
#: Lengths are >= 2 (Dynamo specialises sizes 0 and 1) and off the tile size's multiples.
TILED = [
    ("linear", "split_k", "small-4x64x32", "k", (300, 700, 1100, 2000)),
    ("matmul", "tiled", "batched-3x17x64x9", "k", (100, 300, 500, 1000)),
    ("softmax", "online", "rows-8x4096", "cols", (300, 700, 1100, 2000)),
    ("log_softmax", "online", "noncontig-7x1031", "vocab", (5000, 9000, 13000, 20000)),
    ("cross_entropy", "online", "noncontig-7x1031", "vocab", (5000, 9000, 13000, 20000)),
    ("cumsum", "chunked", "rows-4x1000", "length", (100, 300, 500, 1000)),
    ("linear_attention", "chunked", "small-1x2x37x16", "tokens", (37, 100, 200, 300)),
    ("fp8_block_gemm", "k_blocks", "blocks-4x512x256", "k", (300, 640, 1000, 1500)),
    ("int4_gemm", "grouped", "gptq-4x256x512-int32", "k", (1100, 2100, 2700, 3500)),
    ("attention", "tiled", "decode-2x8x2x1x300x64", "keys", (100, 300, 500, 1000)),
    ("attention_sinks", "tiled", "decode-window-2x8x1x1x300x64", "keys", (100, 300, 500, 1000)),
    ("kv_quant_attention", "fused", "fp8-head-decode-2x8x2x1x300x64", "keys", (100, 300, 500)),
]


def _counting_spec(name: str) -> tuple[CompileSpec, CompileCounter]:
    from torch._dynamo import register_backend

    counter = CompileCounter()
    register_backend(counter, name=name)
    return CompileSpec(name), counter


@pytest.mark.parametrize(
    ("operator", "name", "base", "param", "lengths"), TILED, ids=[f"{o}-{n}" for o, n, *_ in TILED]
)
def test_a_tiled_candidate_compiles_once_for_every_length(
    operator: str, name: str, base: str, param: str, lengths: tuple[int, ...]
) -> None:
    op, cand = OPERATORS[operator], candidates(operator)[name]
    spec, counter = _counting_spec(f"numalign_count_{operator}_{name}")
    fn: Callable[..., Any] = compiled_function(cand.fn, spec, f"{operator}/{name}")
    counts = []
    for length in lengths:
        case = _case_with(operator, base, **{param: length})
        inputs = op.make_inputs(case, torch.Generator().manual_seed(length))
        expected = cand.fn(**inputs)
        actual = fn(**inputs)
        for got, want in zip(
            actual if isinstance(actual, tuple) else (actual,),
            expected if isinstance(expected, tuple) else (expected,),
            strict=True,
        ):
            # Dynamo's eager backend runs the traced ops themselves: identical results
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        counts.append(counter.frame_count)
    # the first length compiles static graphs, the second dynamic ones (Dynamo's automatic
    # dynamic shapes); every later length must reuse them. A Python loop over the tiles
    # would guard on the tile count and compile again for each new length.
    assert counts[-1] == counts[1], f"graphs after each length: {counts}"
