"""Recompile limits under ``--compile``: a worker compiles hundreds of capture points whose
modules enter through the same code, and that must not read as a runaway; a function that
recompiles on every call still ends in a CompileError, never in silent eager code.

Dynamo's own ``eager`` backend keeps each compilation to milliseconds (tracing, no code
generation): what is tested is Dynamo's cache bookkeeping, which every backend shares."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from numalign.replay.compiled import (
    RECOMPILE_LIMIT,
    CompileError,
    CompileSpec,
    compile_model,
    compiled_function,
)

SPEC = CompileSpec("eager")


class Layer(torch.nn.Module):
    """A layer whose index is a constant of its code (as a decoder layer's ``layer_idx``
    picks its cache slot or attention type): Dynamo compiles each instance apart."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x)) + self.index


def test_points_beyond_the_per_function_limit_compile_and_run() -> None:
    # twice the per-function limit of compiled points, each a new entry on the code every
    # point's module enters through: with one shared limit the 65th would fail
    count = 2 * RECOMPILE_LIMIT
    model = torch.nn.Sequential(*(Layer(i) for i in range(count)))
    compiled = compile_model(model, SPEC, points=[])
    x = torch.randn(3, 4)
    for i in range(count):
        out = compiled.get_submodule(str(i))(x)
        torch.testing.assert_close(out, model[i](x))


def test_a_function_recompiling_on_every_call_is_an_error() -> None:
    def runaway(x: torch.Tensor, tag: str) -> torch.Tensor:
        return x * len(tag)  # a string argument is a guarded constant: each new tag recompiles

    fn = compiled_function(runaway, SPEC, "runaway candidate")
    x = torch.randn(2)
    calls: list[Any] = []
    with pytest.raises(CompileError, match=r"runaway candidate .*recompile limit"):
        for i in range(RECOMPILE_LIMIT + 1):
            calls.append(fn(x, "t" * (i + 1)))
    assert len(calls) == RECOMPILE_LIMIT  # every call before the limit ran compiled
