"""Decode replay: each golden request's prefill with a KV cache of a chosen implementation,
then its decode steps teacher-forced with the golden tokens, every step's new-token outputs at
every capture point, its logits, and the cache's contents after the prefill and after the last
step, each against the golden one within the set's decode calibration. The first divergence
is named by step and point.

``run_decode`` is the one loop with a KV cache; calibration (``replay.calibrate``) feeds it the
reference model in a lower dtype and keeps the errors, replay (``replay_decode``) judges them,
and the paged serving engine (``replay.paged``) hands on the same pairs
``(request, step, point, path, actual, expected)``: capture points by name, the logits under
``OUTPUT_POINT`` and the cache's states under ``CACHE_POINT`` (step 0 is the prefill's cache).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from numalign.compare.model_verdict import ReplayUnsupported, Uncalibrated
from numalign.core import dtypes
from numalign.core.observation import Observation
from numalign.golden.decode import cache_family, step_outputs
from numalign.golden.manifest import CACHE_POINT, OUTPUT_POINT
from numalign.golden.reference import (
    CacheUnsupported,
    cache_state,
    decode_inputs,
    filled_cache,
    new_cache,
    prefill_kwargs,
    reset_decode_state,
)
from numalign.golden.requests import unservable
from numalign.replay.judging import judged_decode
from numalign.replay.layer import CallOrder
from numalign.replay.model import hidden_and_depth
from numalign.replay.observe import observe_calls
from numalign.replay.pipeline import Stage, StageRanks, stage_of
from numalign.replay.shards import whole

if TYPE_CHECKING:
    import torch

    from numalign.compare.decode_verdict import DecodeVerdict
    from numalign.golden.store import GoldenSet

#: What ``run_decode`` hands on: (request, step, point, output path, actual, expected), and
#: for capture points ``call=`` (which call of the point in the step, from 0; default 0).
OnPair = Callable[..., None]


def run_decode(
    golden: GoldenSet,
    model: Any,
    request: str,
    implementation: str,
    dtype: torch.dtype,
    device: torch.device | str,
    on_pair: OnPair,
    on_call: Callable[..., None] | None = None,
) -> None:
    """Replays ``request``'s cached decode with a cache of ``implementation``: the prefill,
    then each golden step's token (teacher-forced, so every step compares like with like);
    calls ``on_pair`` for every golden output of every step, the logits, and the cache's
    states after the prefill (step 0) and after the last step; and ``on_call(step, point,
    call, args, kwargs, output)`` for every call of a capture point at a step (args and
    kwargs None for a compiled model)."""
    import torch

    decode = golden.decode(request)
    if decode is None:
        raise ValueError(f"{golden.path}: request {request!r} has no decode steps")
    limit = decode.cache_limits.get(cache_family(implementation))
    if limit is not None:
        raise CacheUnsupported(
            f"the reference itself could not decode request {request!r} with a "
            f"{cache_family(implementation)} cache at capture, a limit of the model's code, "
            f"not of this device: {limit}"
        )
    inputs = {
        k: golden.tensor(v, device=device, dtype=dtype)
        for k, v in golden.request(request).inputs.items()
    }
    length = int(inputs["input_ids"].shape[1])
    mask = golden.tensor(golden.request(request).inputs["attention_mask"]).bool()
    cache = new_cache(model, implementation, length + len(decode.steps))
    stage = stage_of(model)  # a pipeline rank's: the states of its own layers
    reset_decode_state(model)
    try:
        with torch.no_grad():
            cache = filled_cache(model(**inputs, **prefill_kwargs(model, inputs, cache)), cache)
            _compare_cache(golden, request, decode.prefill_cache, cache, mask, 0, on_pair, stage)
            for number, step in enumerate(decode.steps, start=1):
                token = golden.tensor(step.token, device=device)
                inputs, forward = decode_inputs(model, inputs, token, cache)
                mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=torch.bool)], dim=1)
                observe = _step_observer(golden, request, step.points, number, on_pair,
                                         on_call)  # fmt: skip
                with observe_calls(model, list(step.points), observe):
                    logits = model(**forward).logits[:, -1]
                on_pair(request, number, OUTPUT_POINT, "logits", logits.detach(),
                        golden.tensor(step.logits))  # fmt: skip
            _compare_cache(golden, request, decode.final_cache, cache, mask, len(decode.steps),
                           on_pair, stage)  # fmt: skip
    finally:
        reset_decode_state(model)


def _step_observer(
    golden: GoldenSet,
    request: str,
    points: dict[str, list[dict[str, str]]],
    number: int,
    on_pair: OnPair,
    on_step_call: Callable[..., None] | None = None,
) -> Callable[[str, Any, Any, Any], None]:
    """A hook callback comparing each call of each point in this step with its recorded
    call's outputs (``CallOrder.for_steps``: told apart as the request's prefill calls are)
    and handing each call on to ``on_step_call``."""
    import torch

    orders: dict[str, CallOrder] = {}

    def on_call(point: str, args: Any, kwargs: Any, output: Any) -> None:
        calls = points.get(point, [])
        if point not in orders:
            prefill = golden.point(point).calls.get(request, [])
            orders[point] = CallOrder.for_steps(prefill, len(calls))
        index = orders[point].index(args, kwargs)
        if on_step_call is not None:  # every call, a call not recorded by its place in order
            place = orders[point].calls - 1
            on_step_call(number, point, place if index is None else index, args, kwargs, output)
        if index is None:
            return
        for path, tensor in step_outputs(output):  # a router's routing as the step stores it
            key = calls[index].get(path)
            if key is not None and isinstance(tensor, torch.Tensor):
                on_pair(request, number, point, path, tensor.detach(), golden.tensor(key),
                        call=index)  # fmt: skip

    return on_call


def _compare_cache(
    golden: GoldenSet,
    request: str,
    recorded: dict[str, str],
    cache: Any,
    mask: torch.Tensor,
    number: int,
    on_pair: OnPair,
    stage: Stage | None = None,
) -> None:
    """Each recorded cache state against the cache's: keys and values on the most recent
    positions both hold (a sliding-window layer of one implementation may keep one position
    fewer than another's), at the positions the attention mask keeps (padding's keys are
    not defined; positions before the input's, which a model holds of its own, CpmAnt's
    prompt, are kept); linear-attention states whole. On a pipeline rank (``stage``), the
    states of its own layers only (another rank's layers hold places, not states)."""
    import torch

    actual_states = cache_state(cache)
    for name, key in recorded.items():
        if stage is not None and not stage.observes(CACHE_POINT, name):
            continue
        expected = golden.tensor(key)
        actual = actual_states.get(name)
        if actual is None:
            raise ValueError(
                f"the {type(cache).__name__} holds no {name!r}, which the golden cache has; "
                f"it holds {', '.join(actual_states) or 'nothing'}"
            )
        if name.endswith((".keys", ".values")):
            held = min(actual.shape[-2], expected.shape[-2])
            own = max(held - mask.shape[1], 0)  # positions the model holds before the input's
            kept = torch.cat([mask.new_ones(mask.shape[0], own), mask], dim=1)[:, -held:]
            expected = expected[..., -held:, :].movedim(2, 1)[kept]
            actual = actual[..., -held:, :].movedim(2, 1)[kept.to(actual.device)]
        on_pair(request, number, CACHE_POINT, name, actual.detach(), expected)


def replay_decode(
    golden: GoldenSet,
    model: Any,
    dtype: str,
    device: torch.device,
    implementation: str,
    policy: Any = None,
) -> DecodeVerdict:
    """Every request's cached decode with ``implementation`` (a KV cache, or ``paged``: the
    paged serving engine), each step's points, cache states and logits against the golden
    ones within the decode calibration."""

    from numalign.replay.paged import replay_paged_requests

    torch_dtype = dtypes.torch_dtype(dtype)
    stage = stage_of(model)
    ranks = None
    if stage is not None:  # every rank's stage, in the order one process judges them
        stage.start()
        order = {name: i for i, name in enumerate(golden.decode_requests)}

        def key(r: Any) -> tuple[int, int, bool]:
            step = r.step or 0
            return order.get(r.request, -1), step, r.point == CACHE_POINT and step > 0

        ranks = StageRanks(stage, key)

    def observe(see: Callable[[Observation], None]) -> dict[str, str]:
        def on_pair(request: str, step: int, point: str, path: str, actual: Any,
                    expected: Any, call: int = 0) -> None:  # fmt: skip
            if stage is not None and not stage.observes(point, path):
                return  # another pipeline rank's layer
            # a tensor-parallel rank's shard gathered whole
            actual = whole(actual.float().cpu().to(torch_dtype), tuple(expected.shape))
            see(Observation(point, path, request, actual, expected, call=call, step=step))

        unmapped: dict[str, str] = {}
        if implementation == "paged":
            served = replay_paged_requests(golden, model, device, on_pair)
            for request in golden.decode_requests:
                reason = unservable(golden.request(request).inputs, golden.tensor)
                if request not in served and reason is not None:
                    unmapped[f"request {request}"] = reason
        else:
            for request in golden.decode_requests:
                run_decode(golden, model, request, implementation, torch_dtype, device, on_pair)
        return unmapped

    return judged_decode(golden, dtype, hidden_and_depth(model), policy, implementation,
                         observe, ranks=ranks).verdict  # fmt: skip


def decode_calibrated(golden: GoldenSet, dtype: str) -> bool:
    """Whether the set holds decode steps and a decode calibration ``dtype`` can use (its own,
    or float16's or bfloat16's, which float32 and float64 borrow)."""
    if not golden.decode_requests:
        return False
    return any(
        golden.calibrated(source, OUTPUT_POINT, "logits", "decode") is not None
        for source in (dtype, "float16", "bfloat16")
    )


class DecodeUnavailable(ReplayUnsupported):
    """The set holds no decode steps the dtype can replay (an encoder, a set captured with
    ``--decode-steps 0`` or in format 1, a dtype the reference could not run in): decode
    replay skips with the reason."""


def _no_decode_steps(golden: GoldenSet, dtype: str) -> str | None:
    """Why the set holds no decode steps ``dtype`` can replay, whatever its calibration."""
    if golden.manifest.format.endswith("/1"):
        return (
            f"{golden.name} is a format 1 golden set, which has no decode steps: capture it "
            "again with this numalign to replay decode"
        )
    if not golden.decode_requests:
        return f"{golden.name} has no decode steps (an encoder, or captured with --decode-steps 0)"
    limit = golden.manifest.dtype_limits.get(dtype)
    if limit is not None:
        return f"the reference itself could not run in {dtype} at capture: {limit}"
    return None


def _uncalibrated(golden: GoldenSet) -> str:
    return f"{golden.name} has no decode calibration: capture it again to replay decode"


def require_decode_replayable(golden: GoldenSet, dtype: str) -> None:
    """Raises why the set cannot be decode-replayed in ``dtype``: ``Uncalibrated`` where it
    holds decode steps ``dtype`` can replay but no decode calibration for them (captured with
    ``--calibrate ''``: the skip leaves a record of rule ``uncalibrated`` that the run's
    verdict counts, NOT JUDGED), ``DecodeUnavailable`` where it holds none."""
    reason = _no_decode_steps(golden, dtype)
    if reason is not None:
        raise DecodeUnavailable(reason)
    if not decode_calibrated(golden, dtype):
        raise Uncalibrated(f"{_uncalibrated(golden)} (--calibrate {dtype})")
