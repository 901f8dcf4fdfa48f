"""vLLM's attention and decoder layers replayed alone, inside the served model: the module
that runs attention cannot run by itself (it needs the engine's forward context: attention
metadata, the KV cache and its block tables), so the golden rows are served again, prompts
only, in the arrangement that found the divergence, and the module's input is replaced at
every scheduled token by the golden input at that row and position. Its KV cache is then
written from the golden inputs and its attention reads them, with vLLM's own metadata,
blocks, chunking and kernels: the module alone on the golden inputs, as
``replay.engines.vllm_alone`` runs the modules that need no context. The modules before it
run on the engine's own values and are not judged here; the modules after it see what it
made of the golden inputs and are not judged either.

vLLM's decoder layers carry the residual stream as two tensors (``hidden``, ``residual``)
whose sum is the reference's layer input: the golden input goes in ``hidden`` and zeros in
``residual``, so the fused add gives the golden stream (a GPT-2 block, which carries the
stream in one tensor, just the golden input). An attention module is handed the golden input
of the reference's attention (the normed hidden states).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

from numalign.core import dtypes
from numalign.core.observation import Observation
from numalign.golden.positions import expected_at
from numalign.replay.engines.vllm_serving import (
    Running,
    Served,
    engine_rows,
    prompt_rows,
    serve_rows,
)
from numalign.replay.layer import AloneUnsupported, request_mask
from numalign.runtime.serving import Arrangement

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet, Point

See = Callable[[Observation], None]


def runs_attention(module: Any) -> bool:
    """Whether vLLM's ``module`` runs attention (holds an ``Attention`` layer), which needs
    the engine's forward context: replayed alone inside the served model."""
    return any(type(m).__name__ == "Attention" for _, m in module.named_modules())


def observe_in_context(
    running: Running,
    golden: GoldenSet,
    point: Point,
    module_name: str,
    dtype: str,
    arrangement: Arrangement,
    see: See,
) -> None:
    """``point``'s vLLM module ``module_name`` fed the golden inputs inside the served model
    (module doc), every served request's output handed to ``see`` beside the golden one;
    AloneUnsupported saying why where the set holds no input to feed it."""
    torch_dtype = dtypes.torch_dtype(dtype)
    rows = _golden_rows(golden, point, module_name, torch_dtype)
    module = running.model.get_submodule(module_name)
    also = partial(_substituted, module, rows)
    served = serve_rows(running, golden, arrangement, decode=False, also=also)
    for request, calls in point.calls.items():
        engine = engine_rows(golden, request)
        if engine is None or not calls or any(row not in rows for row, _ in engine):
            continue
        actual = prompt_rows(served, engine, module_name).to(torch_dtype)
        expected = expected_at(golden, calls[0].outputs["0"], request_mask(golden, request))
        see(Observation(point.name, "0", request, actual, expected, finished=0))


def hidden_states_key(point: Point, call: Any, module_name: str) -> str:
    """The key of a golden call's hidden-states input (its first argument, or the keyword),
    which feeds vLLM's ``module_name`` alone; AloneUnsupported where it has none."""
    args = call.args
    key = args[0] if args and args[0] is not None else call.kwargs.get("hidden_states")
    if not isinstance(key, str):
        raise AloneUnsupported(
            f"the golden call of {point.name} has no hidden-states input to feed vLLM's "
            f"{module_name}"
        )
    return key


def _golden_rows(
    golden: GoldenSet, point: Point, module_name: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The golden input of ``point`` per engine row: [prompt length, hidden] at the row's
    kept positions (the positions vLLM numbers 0, 1, ...)."""
    rows: dict[str, torch.Tensor] = {}
    for request, calls in point.calls.items():
        engine = engine_rows(golden, request)
        if engine is None or not calls:
            continue
        key = hidden_states_key(point, calls[0], module_name)
        tensor = golden.tensor(key)  # StatisticsOnly where the set keeps no such tensor
        mask = request_mask(golden, request)
        for b, (row, length) in enumerate(engine):
            kept = tensor[b] if mask is None else tensor[b][mask[b].bool()]
            if kept.shape[0] != length:
                raise AloneUnsupported(
                    f"{point.name}'s golden input for {row} has {kept.shape[0]} positions, the "
                    f"served row {length}"
                )
            rows[row] = kept.to(dtype)
    if not rows:
        raise AloneUnsupported(f"the set holds no servable request of {point.name}")
    return rows


def _argument(module: Any, name: str) -> int | None:
    """Where ``module``'s forward takes ``name`` positionally (after ``self``), None where it
    has no such parameter: vLLM's Llama-like layers take ``(positions, hidden_states,
    residual)``, its GPT-2 blocks and attention ``(hidden_states)`` alone."""
    import inspect

    params = list(inspect.signature(module.forward).parameters)
    return params.index(name) if name in params else None


@contextmanager
def _substituted(
    module: torch.nn.Module, rows: dict[str, torch.Tensor], served: Served
) -> Iterator[None]:
    """While served, ``module``'s hidden-states input replaced at every scheduled token of a
    row in ``rows`` by that row's golden input at the token's position (``served.layout``,
    filled by the model's own pre-hook before any layer runs); a decoder layer's residual,
    where it takes one, by zeros. Arguments are found by their names in the forward's
    signature."""
    hidden_at, residual_at = _argument(module, "hidden_states"), _argument(module, "residual")
    if hidden_at is None:
        raise AloneUnsupported(f"vLLM's {type(module).__name__} takes no hidden_states")

    def replaced(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, at: int,
                 new: Callable[[Any], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:  # fmt: skip
        if name in kwargs:
            return args, {**kwargs, name: new(kwargs[name])}
        if at < len(args):
            return (*args[:at], new(args[at]), *args[at + 1 :]), kwargs
        return args, kwargs

    def golden_at_rows(hidden: torch.Tensor) -> torch.Tensor:
        golden = hidden.clone()
        for row, start, count, first in served.layout:
            if count and row in rows:
                golden[start : start + count] = rows[row][first : first + count].to(golden)
        return golden

    def zeros(residual: Any) -> Any:
        import torch

        return torch.zeros_like(residual) if isinstance(residual, torch.Tensor) else residual

    def substitute(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args, kwargs = replaced(args, kwargs, "hidden_states", hidden_at, golden_at_rows)
        if residual_at is not None:
            args, kwargs = replaced(args, kwargs, "residual", residual_at, zeros)
        return args, kwargs

    handle = module.register_forward_pre_hook(substitute, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
