"""Recompile limits and known compiler bugs under ``--compile``: a worker compiles hundreds
of capture points whose modules enter through the same code, and that must not read as a
runaway; a function that recompiles on every call still ends in a CompileError, never in
silent eager code; a known upstream compiler bug is named as such, and only that one.

Dynamo's own ``eager`` backend keeps each compilation to milliseconds (tracing, no code
generation): what is tested is Dynamo's cache bookkeeping, which every backend shares."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from numalign.runtime.compiled import (
    RECOMPILE_LIMIT,
    CompileError,
    CompileSpec,
    compiled_function,
)
from numalign.runtime.compiled_model import compile_model

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


def _registered(name: str, backend: Callable[..., Any]) -> CompileSpec:
    """``backend`` registered with Dynamo as ``name``: the spec that compiles with it."""
    from torch._dynamo import register_backend

    register_backend(backend, name=name)
    return CompileSpec(name)


def _backend_failing_with(name: str, output: str) -> CompileSpec:
    """A backend (registered as ``name``) whose C++ compiler rejects the generated kernel
    with ``output``, as Inductor's does when its code generation is wrong."""
    from torch._inductor.exc import CppCompileError

    def backend(gm: Any, example_inputs: Any) -> Any:
        raise CppCompileError(["g++", "kernel.cpp"], output)

    return _registered(name, backend)


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_known_compiler_bug_is_named_and_nothing_else_is() -> None:
    known = _backend_failing_with(
        "numalign_known_cpp_bug",
        "kernel.cpp:331:49: error: \u2018tmp6\u2019 was not declared in this scope; did you "
        "mean \u2018tmp1\u2019?",
    )
    other = _backend_failing_with(
        "numalign_other_cpp_bug",
        "kernel.cpp:12:3: error: expected \u2018;\u2019 before \u2018}\u2019",
    )
    fn = compiled_function(_double, known, "candidate")
    with pytest.raises(CompileError) as caught:
        fn(torch.ones(2))
    assert caught.value.known is not None and "Inductor's C++ code generation" in caught.value.known
    # the failed compilation's cost goes with its error, not to the next test of the candidate
    assert caught.value.spent is not None and caught.value.spent.compile_s > 0
    assert fn.stats.compile_s == 0
    with pytest.raises(CompileError) as caught:
        compiled_function(_double, other, "candidate")(torch.ones(2))
    assert caught.value.known is None


def test_inductors_dynamic_stride_check_bug_is_known_only_as_inductors() -> None:
    # Inductor wraps the ValueError of its stride-order check (pytorch/pytorch#188323) in an
    # InductorError; the same message raised by the code being compiled is that code's own
    # error and propagates as it is
    from torch._inductor.exc import InductorError

    def failing_backend(gm: Any, example_inputs: Any) -> Any:
        raise InductorError(ValueError("Exponent must be non-negative."), None)

    spec = _registered("numalign_stride_check_bug", failing_backend)

    def own_error(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("Exponent must be non-negative.")

    with pytest.raises(CompileError) as caught:
        compiled_function(_double, spec, "candidate")(torch.ones(2))
    assert caught.value.known is not None and "stride-order check" in caught.value.known
    with pytest.raises(ValueError, match="Exponent must be non-negative"):
        compiled_function(own_error, CompileSpec("eager"), "candidate")(torch.ones(2))


def test_a_note_the_compiler_warns_is_shown_not_a_compile_error() -> None:
    # Inductor warns from its lowering module when it leaves complex operators to eager
    # (rotary embeddings in complex form met it); where warnings are errors, as in these
    # tests, that note must not fail the compilation
    def noting_backend(gm: Any, example_inputs: Any) -> Any:
        warnings.warn_explicit(
            "Torchinductor does not support code generation for complex operators.",
            UserWarning, "lowering.py", 1, module="torch._inductor.lowering",
        )  # fmt: skip
        return gm.forward

    spec = _registered("numalign_noting_backend", noting_backend)
    fn = compiled_function(_double, spec, "candidate")
    with pytest.warns(UserWarning, match="complex operators"):
        warnings.simplefilter("error")  # as the ini does (pytest.warns would record them all)
        out = fn(torch.ones(2))
    torch.testing.assert_close(out, torch.full((2,), 2.0))
