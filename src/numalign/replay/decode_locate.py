"""Locating a decode divergence: is the first failing point at its step wrong itself, or fed
a wrong input?

A decode step's inputs are not in the golden set (only each point's new-token outputs are),
so the point is checked on the very input the replay fed it: the module run again on that
input in float32 (a float32 copy of it, the input upcast) is what an exact module computes
there, and the candidate's output against it is the module's own error at this step, judged
against the point's isolated calibration (the module's own error in the dtype on golden
inputs). Beyond it: ``local``. Within it: the error came with its input (``accumulated``),
and the points that ran before it at the step are checked the same way, latest first; the
first of them beyond its own budget is named (a norm computed in low precision whose output
stays within its decode budget, yet pushes the MLP after it over).

Modules that take a KV cache (attention, decoder blocks) are not run again (a second call
would write the cache twice): such a point is ``unlocated`` with that reason, and so is a
step the replay cannot revisit (a compiled model).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from numalign.compare.locate import locate_in_step
from numalign.compare.model_judge import ModelJudge
from numalign.compare.model_verdict import DecodeLocation
from numalign.core import dtypes
from numalign.core.observation import Observation
from numalign.golden.decode import step_outputs
from numalign.golden.manifest import CACHE_POINT, OUTPUT_POINT
from numalign.replay.decode import run_decode
from numalign.replay.inputs import detached
from numalign.replay.model import hidden_and_depth
from numalign.replay.shards import whole

if TYPE_CHECKING:
    import torch

    from numalign.compare.model_verdict import PointResult
    from numalign.golden.store import GoldenSet

#: Keyword inputs that mark a module whose call writes a KV cache.
_CACHE_KWARGS = ("past_key_values", "cache", "past_key_value", "layer_past")


@dataclass
class _StepCall:
    point: str
    index: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any


def locate_decode(
    golden: GoldenSet,
    model: Any,
    first: PointResult,
    dtype: str,
    device: torch.device | str,
    implementation: str,
    policy: Any = None,
) -> DecodeLocation | None:
    """The location of decode's first failing point ``first`` (None for the cache's states,
    the logits and pooled leans, which name no module call at one step)."""
    if first.step is None or first.step < 1 or first.point in (CACHE_POINT, OUTPUT_POINT):
        return None
    if not hasattr(model, "get_submodule"):
        return DecodeLocation("unlocated", None, "a compiled model's steps are not revisited")
    calls = _step_calls(golden, model, first.request, first.step, dtype, device, implementation)
    mine = next((c for c in calls if c.point == first.point and c.index == first.call), None)
    if mine is None:
        return DecodeLocation("unlocated", None, f"{first.point} was not called at the step")
    judge = ModelJudge(golden, dtype, "isolated", hidden_and_depth(model), policy).judge
    before = reversed(calls[: calls.index(mine)])  # latest first
    return locate_in_step(
        first,
        _own_error(model, mine, first.path, first.request),
        [partial(_own_error, model, call, "0", first.request) for call in before],
        lambda seen: judge.compare(seen.point, seen.path, seen.actual, seen.expected),
    )


def _step_calls(
    golden: GoldenSet,
    model: Any,
    request: str,
    step: int,
    dtype: str,
    device: torch.device | str,
    implementation: str,
) -> list[_StepCall]:
    """Every capture point's call at ``step`` of the request's decode, in completion order,
    with the inputs the replay fed it (a fresh decode with the same cache implementation;
    the paged engine's steps are revisited with the dynamic cache, its modules the same)."""

    found: list[_StepCall] = []

    def on_call(number: int, point: str, index: int, args: Any, kwargs: Any, output: Any) -> None:
        if number == step and args is not None:
            found.append(_StepCall(point, index, detached(args), detached(kwargs), output))

    cache = "dynamic" if implementation == "paged" else implementation
    run_decode(golden, model, request, cache, dtypes.torch_dtype(dtype), device,
               lambda *a, **k: None, on_call=on_call)  # fmt: skip
    return found


def _own_error(model: Any, call: _StepCall, path: str, request: str) -> Observation | str:
    """The call's output beside its module's in float32 on the same input (its own error at
    the step); a string saying why the module cannot run again."""
    import torch

    if any(k in call.kwargs for k in _CACHE_KWARGS) or not call.args:
        return f"{call.point} takes the KV cache: not run again at one step"
    module = model.get_submodule(call.point)
    actual = dict(step_outputs(call.output)).get(path)
    if not isinstance(actual, torch.Tensor) or not actual.is_floating_point():
        return f"{call.point} has no floating output {path}"
    exact = copy.deepcopy(module).float()
    with torch.no_grad():
        reference = dict(step_outputs(exact(*_up(call.args), **_up(call.kwargs)))).get(path)
    if not isinstance(reference, torch.Tensor):
        return f"{call.point}'s float32 copy gives no output {path}"
    expected = reference.detach().double().cpu()
    actual = whole(actual.detach().cpu(), tuple(expected.shape))  # a tensor-parallel shard
    return Observation(call.point, path, request, actual, expected, call=call.index)


def _up(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_up(v) for v in value)
    if isinstance(value, list):
        return [_up(v) for v in value]
    if isinstance(value, dict):
        return {k: _up(v) for k, v in value.items()}
    return value
