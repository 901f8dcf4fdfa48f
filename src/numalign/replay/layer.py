"""Layer replay: one capture point's module fed the golden inputs of one recorded call."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from numalign.compare.exact import LeftOut, fill_faults
from numalign.core.errors import Unsupported
from numalign.core.statistics import Expected, TensorStatistics
from numalign.golden.positions import by_position, kept_positions
from numalign.golden.reference import hooks, jsonable
from numalign.golden.routing import point_tensors

if TYPE_CHECKING:
    import torch

    from numalign.golden.manifest import KeyTree
    from numalign.golden.store import Call, GoldenSet


class AloneUnsupported(Unsupported, RuntimeError):
    """A module that needs state the model shares between layers (Gemma 4's
    ``shared_kv_states``) cannot be replayed alone: its layer replay and isolated calibration
    are skipped with the reason."""


def shared_inputs(call: Call) -> dict[str, str]:
    """The call's non-tensor objects other than caches, by keyword, with their type: what a
    replay feeds as None (``call_inputs``), so a module that writes or reads them cannot run
    alone."""
    out = {}
    for name, value in call.kwargs_json.items():
        kind = value.get("__repr__") if isinstance(value, dict) else None
        if isinstance(kind, str) and not kind.endswith("Cache"):
            out[name] = kind
    return out


def call_inputs(
    golden: GoldenSet, call: Call, *, device: torch.device | str, dtype: torch.dtype
) -> tuple[list[Any], dict[str, Any]]:
    """The call's positional and keyword inputs, floating tensors cast to ``dtype`` on
    ``device``; non-tensor values from the manifest (objects such as caches become None)."""

    def load(key: str) -> Any:
        return within_range(golden.tensor(key, device=device), dtype)

    def plain(value: Any) -> Any:
        return None if isinstance(value, dict) and "__repr__" in value else value

    def rebuilt(keys: KeyTree) -> Any:  # the input in its recorded shape (tuples as tuples)
        if isinstance(keys, str):
            return load(keys)
        if isinstance(keys, dict):
            return {k: rebuilt(v) for k, v in keys.items()}
        return None if keys is None else tuple(rebuilt(k) for k in keys)

    args = [
        rebuilt(k) if k is not None else plain(j)
        for k, j in zip(call.args, call.args_json, strict=True)
    ]
    kwargs: dict[str, Any] = {name: rebuilt(keys) for name, keys in call.kwargs.items()}
    for name, value in call.kwargs_json.items():
        kwargs[name] = plain(value)
    return args, kwargs


def input_dtype(module: torch.nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The one dtype a module's floating parameters are all kept in (a model's
    ``_keep_in_fp32_modules``: HY-V4's float32 LM head and router, DeepSeek-V3's router
    weight on transformers 5.24); ``dtype`` where they are in several or none."""
    kept = {p.dtype for p in module.parameters() if p.is_floating_point()}
    return kept.pop() if len(kept) == 1 else dtype


def fed_dtypes(module: torch.nn.Module, dtype: torch.dtype) -> list[torch.dtype]:
    """The dtypes a module replayed alone is fed in, in the order tried: the run's, then,
    for a module kept in another dtype (``input_dtype``), that one where the run's is
    refused. The model feeds a module what it takes: HY-V4's float32 head cannot take
    bfloat16 (``expected m1 and m2 to have the same dtype``), so its model feeds it float32;
    DeepSeek-V3's router casts its input to float32 itself, and its model feeds it the
    hidden states in the run's dtype, which layer replay tries first (fed float32, its
    isolated budget would be float32's, far below what an honest router in the run's dtype
    errs)."""
    kept = input_dtype(module, dtype)
    return [dtype] if kept == dtype else [dtype, kept]


def within_range(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A floating golden tensor in ``dtype``, its finite values kept finite: a float32
    attention mask's minimum (-3.4e38, "masked") rounds to -inf in bfloat16, where the model's
    own mask in bfloat16 holds bfloat16's minimum. With -inf, a fully masked padding row's
    softmax is NaN, which a second attention in the same layer (LongCat-Flash's two sublayers)
    reads back as values of the real rows' keys (0 x NaN): a NaN the reference never has."""
    import torch

    if not tensor.is_floating_point():
        return tensor
    if torch.finfo(dtype).max >= torch.finfo(tensor.dtype).max:
        return tensor.to(dtype)
    finfo = torch.finfo(dtype)
    clamped = tensor.clamp(finfo.min, finfo.max)
    return torch.where(tensor.isfinite(), clamped, tensor).to(dtype)


def left_out(
    actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor | None
) -> LeftOut | None:
    """What is wrong in the rows ``kept_positions`` leaves out of the candidate's output
    (``actual``, the golden ``expected`` of the same shape): values that are not finite
    where the golden ones are (a NaN there reaches the real rows at the next attention), or,
    for a mask (``expected`` boolean), an additive fill that breaks softmax
    (``compare.exact.fill_faults``); None where nothing is left out or nothing is wrong."""
    import torch

    if actual.shape != expected.shape:
        return None
    laid_a, laid_e = by_position(actual, mask), by_position(expected, mask)
    if laid_a is None or laid_e is None or mask is None:
        return None
    (a, keep), (e, _) = laid_a, laid_e
    out = ~keep
    if not bool(out.any()):
        return None
    a_out, e_out = a[out], e.to(a.device)[out]  # [left-out rows, ...]
    if e.dtype == torch.bool:
        faults, what = fill_faults(a_out), "fill"
    elif a.is_floating_point():
        faults, what = ~a_out.isfinite() & e_out.isfinite(), "values"
    else:
        return None
    bad = faults.reshape(faults.shape[0], -1).any(-1)
    if not bool(bad.any()):
        return None
    seq = mask.shape[1]
    positions = out.nonzero()[bad.to(out.device)]
    rows = tuple(
        (int(p[0]), int(p[1])) if p.numel() == 2 else divmod(int(p[0]), seq) for p in positions
    )
    return LeftOut(rows, int(faults.sum()), int(out.sum()), what)


def request_mask(golden: GoldenSet, request: str) -> torch.Tensor | None:
    """The attention mask of a golden request, where it has one."""
    key = golden.request(request).inputs.get("attention_mask")
    return golden.tensor(key) if key is not None else None


class CallOrder:
    """Which recorded call of a point each live call of it in a forward is (``index``, in the
    order the live calls come). A module called several times in a forward is not always
    called in the same order in every process: Gemma 3 and 4 call their rotary embedding
    once per layer type in the order of a ``set`` of the layer types' names, which Python's
    string hashing (``PYTHONHASHSEED``, random per process) orders anew in each process, so
    a calibration member or a replay may call "sliding_attention" first where the capture
    called "full_attention" first. A live call is therefore the n-th of the recorded calls
    whose plain non-tensor inputs (strings, numbers, booleans: the layer type) that tell
    the point's calls apart are its own; where none tells them apart, where the live inputs
    are not known (``args`` None: a compiled model's taps) or where no recorded call had
    them (a decode step's own value), the n-th call in order. None: a call that was not
    recorded (more calls than the capture's)."""

    def __init__(self, calls: Sequence[Call] | int) -> None:
        """``calls``: the point's recorded calls, or how many calls there are whose inputs
        the set does not hold (they go in order)."""
        recorded = (
            [{}] * calls
            if isinstance(calls, int)
            else [_plain_inputs(c.args_json, c.kwargs_json) for c in calls]
        )
        names = sorted({name for inputs in recorded for name in inputs})
        self.telling = [n for n in names if len({i.get(n) for i in recorded}) > 1]
        self.recorded = [self._key(inputs) for inputs in recorded]
        self.calls = 0
        self.seen: Counter[tuple[str | None, ...]] = Counter()

    @classmethod
    def for_steps(cls, prefill: Sequence[Call], step_calls: int) -> CallOrder:
        """The order of a decode step's ``step_calls`` calls of a point, which the set holds
        without their inputs: a step of the capture called the point as its request's
        prefill did (one process, one order), so the prefill's calls tell the step's apart
        where there are as many; elsewhere the step's calls go in order."""
        return cls(prefill if len(prefill) == step_calls else step_calls)

    def _key(self, inputs: dict[str, str]) -> tuple[str | None, ...]:
        return tuple(inputs.get(name) for name in self.telling)

    def index(self, args: Sequence[Any] | None, kwargs: dict[str, Any] | None) -> int | None:
        number = self.calls
        self.calls += 1
        if not self.telling or args is None:
            return number if number < len(self.recorded) else None
        key = self._key(_plain_inputs(
            tuple(jsonable(a) for a in args), {k: jsonable(v) for k, v in (kwargs or {}).items()}
        ))  # fmt: skip
        nth = self.seen[key]
        self.seen[key] = nth + 1
        same = [i for i, k in enumerate(self.recorded) if k == key]
        if not same:
            return number if number < len(self.recorded) else None
        return same[nth] if nth < len(same) else None


def _plain_inputs(args_json: Sequence[Any], kwargs_json: dict[str, Any]) -> dict[str, str]:
    """A call's plain non-tensor inputs as JSON text, by ``args[i]`` or keyword (the manifest's
    ``args_json`` and ``kwargs_json``, or ``jsonable`` of a live call's): tensors (recorded
    as None positionally, not at all by keyword), None and objects (a marked repr: a cache,
    whose class may differ between replays) tell nothing."""
    named = {f"args[{i}]": v for i, v in enumerate(args_json)} | dict(kwargs_json)
    return {
        name: json.dumps(value)
        for name, value in named.items()
        if value is not None and not isinstance(value, dict)
    }


class CallMatcher:
    """A hook callback (``golden.reference.hooks``' ``on_call``) that matches each call of a
    point in a forward with its recorded call of ``request`` (``CallOrder``) and calls
    ``on_output(point, path, actual, expected, call)`` for each of its tensor outputs the
    golden set holds, both restricted to the positions the request's mask keeps (``call``:
    which call of the point, from 0). ``on_left_out(point, path, faults, call)``, where
    given, is called first with what is wrong in the rows the mask leaves out (``left_out``),
    only where something is."""

    def __init__(
        self,
        golden: GoldenSet,
        request: str,
        on_output: Callable[[str, str, torch.Tensor, Expected, int], None],
        on_left_out: Callable[[str, str, LeftOut, int], None] | None = None,
    ) -> None:
        self.golden, self.request, self.on_output = golden, request, on_output
        self.on_left_out = on_left_out
        self.points = {p.name: p for p in golden.points}
        self.mask = request_mask(golden, request)
        self.orders: dict[str, CallOrder] = {}

    def __call__(self, point: str, args: Any, kwargs: Any, output: Any) -> None:

        calls = self.points[point].calls.get(self.request, [])
        order = self.orders.setdefault(point, CallOrder(calls))
        number = order.index(args, kwargs)
        if number is None:
            return
        for path, tensor in point_tensors(output):
            key = calls[number].outputs.get(path)
            if key is None:
                continue
            actual = kept_positions(tensor.detach(), self.mask)
            golden = self.golden.expected(key)
            if isinstance(golden, TensorStatistics):  # kept as statistics of the kept rows
                self.on_output(point, path, actual, golden, number)
                continue
            if self.on_left_out is not None:
                faults = left_out(tensor.detach(), golden, self.mask)
                if faults is not None:
                    self.on_left_out(point, path, faults, number)
            self.on_output(point, path, actual, kept_positions(golden, self.mask), number)


@contextmanager
def golden_outputs(
    model: torch.nn.Module,
    golden: GoldenSet,
    request: str,
    on_output: Callable[[str, str, torch.Tensor, Expected, int], None],
    on_left_out: Callable[[str, str, LeftOut, int], None] | None = None,
) -> Iterator[None]:
    """While the model runs ``request``, calls ``on_output(point, path, actual, expected)``
    for every tensor output of every capture point that matches a recorded call, and
    ``on_left_out`` where given (``CallMatcher``)."""
    matcher = CallMatcher(golden, request, on_output, on_left_out)
    with hooks(model, [p.name for p in golden.points], matcher):
        yield


def replay_call(
    module: torch.nn.Module,
    golden: GoldenSet,
    call: Call,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Runs ``module`` on the golden inputs of ``call`` (in ``fed_dtypes``); its tensor
    outputs by output path. A module that says how it runs alone (``alone``: a mask point,
    ``golden.mask_points``, which then always builds its mask) is called that way."""
    import torch

    run = getattr(module, "alone", module)
    tried = fed_dtypes(module, dtype)
    for attempt, fed in enumerate(tried, 1):
        args, kwargs = call_inputs(golden, call, device=device, dtype=fed)
        try:
            with torch.no_grad():
                return dict(point_tensors(run(*args, **kwargs)))
        except Exception as exc:
            if attempt < len(tried):  # it takes only the dtype it keeps: fed that one next
                continue
            shared = shared_inputs(call)
            if not shared:
                raise
            raise AloneUnsupported(
                f"{type(module).__name__} cannot run alone: its call took "
                f"{', '.join(f'{n} ({t})' for n, t in shared.items())}, state the model "
                "shares between its layers, which a replay of one module does not have "
                f"({type(exc).__name__}: {exc}); the whole-model and decode replays judge it "
                "within the model"
            ) from exc
    raise AssertionError("fed_dtypes names at least the run's dtype")
