"""A mask point judges what an additive mask fills its masked entries with, and a point's
padding rows, left out of the comparison of values, are judged for values that are not
finite: a wrong fill or a NaN at padding fails at the point that produced it, naming the
left-out rows, instead of one layer later (``compare.exact.judge_mask``,
``replay.layer.left_out``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from numalign.compare import CompareSpec, compare
from numalign.golden.reference import load_model
from numalign.golden.store import GoldenSet
from numalign.replay.layer import request_mask
from numalign.replay.model import replay_layer

ROOT = Path(__file__).resolve().parents[2]
SET = ROOT / "golden" / "sets" / "tiny-llama"
MASK = "model.create_causal_mask"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def golden() -> GoldenSet:
    return GoldenSet.open(SET)


def _replay(
    golden: GoldenSet, point: str, request: str, plant: Callable[[Any, Any], Any] | None
) -> list[Any]:
    """The layer replay of ``point`` on ``request`` in bfloat16 (eager attention: additive
    masks), the point's module wrapped by ``plant(module, output)``."""
    model = load_model(golden.model_dir, "bfloat16", attn_implementation="eager",
                       trust_remote_code=False)  # fmt: skip
    module = model.get_submodule(point)
    if plant is not None:
        module.register_forward_hook(lambda m, args, out: plant(m, out))
    only = dataclasses.replace(golden.point(point), calls={
        request: golden.point(point).calls[request]})  # fmt: skip
    results = replay_layer(golden, model, only, "bfloat16", CPU)
    return [r.result for r in results if r.request == request]  # not the pooled leans


def _first_padding(golden: GoldenSet, request: str) -> tuple[int, int]:
    """The (batch, position) of the request's first padding position."""
    batch, position = (~request_mask(golden, request).bool()).nonzero()[0].tolist()
    return batch, position


def _refilled(fill: float) -> Callable[[Any, Any], Any]:
    """A mask builder whose masked entries (the dtype's minimum) hold ``fill`` instead."""

    def plant(module: Any, out: torch.Tensor) -> torch.Tensor:
        return out.masked_fill(out == torch.finfo(out.dtype).min, fill)

    return plant


def test_the_zoo_s_honest_mask_passes_with_its_fill(golden: GoldenSet) -> None:
    (result,) = _replay(golden, MASK, "text-leftpad", None)
    assert result.passed and result.dtype == "bfloat16", result.message()


def test_a_minus_inf_fill_fails_where_a_padding_row_attends_nowhere(golden: GoldenSet) -> None:
    (result,) = _replay(golden, MASK, "text-leftpad", _refilled(float("-inf")))
    assert not result.passed and result.rule == "non-finite", result.message()
    # left padding: every padding query attends nowhere (16 keys each, all -inf)
    rows = int((~request_mask(golden, "text-leftpad").bool()).sum())
    assert result.reason.startswith(
        f"{rows * 16} mask entries whose fill breaks softmax (NaN, +inf, or -inf in rows that "
        f"attend nowhere) in {rows} of the {rows} padding row(s) the comparison leaves out, "
        f"at (batch, position) {_first_padding(golden, 'text-leftpad')}"
    ), result.reason
    assert "finfo(dtype).min, not -inf" in (result.hint or "")


def test_a_minus_inf_fill_passes_where_every_row_attends_somewhere(golden: GoldenSet) -> None:
    # right padding: each padding query attends the real keys before it; -inf zeroes the
    # masked scores exactly there, and softmax stays defined
    (result,) = _replay(golden, MASK, "text-rightpad", _refilled(float("-inf")))
    assert result.passed, result.message()


@pytest.mark.parametrize("fill", [0.0, -1.0], ids=["zero", "small-negative"])
def test_a_fill_that_does_not_suppress_fails_at_the_mask(golden: GoldenSet, fill: float) -> None:
    (result,) = _replay(golden, MASK, "text-leftpad", _refilled(fill))
    assert not result.passed and result.rule == "exact", result.message()
    assert f"additive mask holds {fill:g}" in (result.hint or "")


def test_a_nan_fill_fails_at_the_mask() -> None:
    # NaN compares below nothing: it reads as masked, so only the fill rule sees it
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, 3, 3).masked_fill(~causal, torch.finfo(torch.float32).min)
    mask[0, 0, 0, 2] = float("nan")
    expected = causal[None, None]
    result = compare(mask, expected, CompareSpec(name="mask"))
    assert not result.passed and result.rule == "non-finite", result.message()
    assert "1 NaN" in result.reason and "(0, 0, 0, 2)" in result.reason


def test_a_nan_only_in_padding_rows_fails_at_the_point_that_produced_it(
    golden: GoldenSet,
) -> None:
    point = "model.layers.0.mlp"
    padding = ~request_mask(golden, "text-leftpad").bool()

    def plant(module: Any, out: torch.Tensor) -> torch.Tensor:
        return out.masked_fill(padding[..., None], float("nan"))

    (result,) = _replay(golden, point, "text-leftpad", plant)
    assert not result.passed and result.rule == "non-finite", result.message()
    rows = int(padding.sum())
    assert result.reason.startswith(  # 64: tiny-llama's hidden size, one NaN per feature
        f"{rows * 64} NaN or Inf value(s) where the reference is finite in {rows} of the "
        f"{rows} padding row(s) the comparison leaves out, at (batch, position) "
        f"{_first_padding(golden, 'text-leftpad')}"
    ), result.reason


def test_a_nan_in_padding_rows_is_the_whole_model_s_first_divergence_where_it_is_made(
    golden: GoldenSet,
) -> None:
    from numalign.replay.model import replay_model

    point = "model.layers.0.mlp"
    model = load_model(golden.model_dir, "bfloat16", attn_implementation="eager",
                       trust_remote_code=False)  # fmt: skip
    padding = ~request_mask(golden, "text-leftpad").bool()

    def plant(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        if out.shape[:2] != padding.shape:  # only the request whose padding is planted
            return out
        return out.masked_fill(padding[..., None], float("nan"))

    model.get_submodule(point).register_forward_hook(plant)
    verdict = replay_model(golden, model, "bfloat16", CPU)
    first = verdict.first_failing
    assert first is not None and first.point == point, first
    assert first.result.rule == "non-finite", first.result.message()
    assert "padding row(s) the comparison leaves out" in first.result.reason
