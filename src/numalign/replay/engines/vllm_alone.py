"""vLLM's modules run alone on the golden inputs: a point's calls through vLLM alone
(``observe_isolated``; attention and decoder layers inside the served model,
``vllm_in_context``), the residual stream of vLLM's fused add + norm beside the reference's
(``observe_residuals``), and the points run alone for the judge to locate a divergence
(``AloneOnVllm``). Each hands the judge observations; none judges."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from numalign.core import dtypes
from numalign.core.observation import Observation
from numalign.core.statistics import TensorStatistics
from numalign.golden.positions import expected_at, kept_positions
from numalign.replay.engines.vllm_in_context import (
    hidden_states_key,
    observe_in_context,
    runs_attention,
)
from numalign.replay.engines.vllm_points import (
    LM_HEAD,
    RESIDUAL,
    PointMap,
    reference_output,
    residual_output,
)
from numalign.replay.engines.vllm_serving import (
    Running,
    Served,
    prompt_rows,
    quiet,
)
from numalign.replay.layer import AloneUnsupported, request_mask
from numalign.runtime.serving import ARRANGEMENTS, DEFAULT_SERVING, Arrangement

if TYPE_CHECKING:
    from numalign.golden.store import GoldenSet, Point

#: Where an engine hands what it observed (``compare.model_judge.ModelJudge.see``).
See = Callable[[Observation], None]


@dataclass
class AloneOnVllm:
    """vLLM's modules run alone on the golden inputs, for the judge to locate a divergence
    (``compare.model_judge.AloneObserver``); the model's own inputs are not taken."""

    running: Running
    golden: GoldenSet
    dtype: str
    #: how the replay that found the divergence served the rows: attention replays alone
    #: served so (``vllm_in_context``)
    arrangement: Arrangement

    def observe_alone(self, point: str, see: See) -> None:
        module = next((m.module for m in self.running.mapping if m.point == point), None)
        if point not in {p.name for p in self.golden.points}:
            raise AloneUnsupported(f"the set has no point {point}")
        observe_isolated(self.running, self.golden, self.golden.point(point), module or "",
                         self.dtype, see, self.arrangement)  # fmt: skip

    def inputs_at_fault(self, failing: Any, compare: Any) -> None:
        return None


def observe_isolated(
    running: Running,
    golden: GoldenSet,
    point: Point,
    module_name: str,
    dtype: str,
    see: See,
    arrangement: Arrangement | None = None,
) -> None:
    """Every recorded call of ``point`` run alone through vLLM's ``module_name`` on the golden
    inputs (their kept positions, flattened as vLLM's tokens), each output handed to ``see``;
    a module that runs attention fed them inside the served model, served in
    ``arrangement`` (the default one where None: ``vllm_in_context``); AloneUnsupported
    saying why where the module cannot run alone."""
    import torch
    from vllm.forward_context import set_forward_context

    if not module_name:
        raise AloneUnsupported(f"{point.name} has no vLLM module")
    model = running.model
    # the head alone is the engine's logits computation on the head's input
    module = _LogitsOf(model) if module_name == LM_HEAD else model.get_submodule(module_name)
    if runs_attention(module):  # it needs the engine's forward context: fed inside the model
        served_so = arrangement or ARRANGEMENTS[DEFAULT_SERVING]
        observe_in_context(running, golden, point, module_name, dtype, served_so, see)
        return
    torch_dtype = dtypes.torch_dtype(dtype)
    for request, calls in point.calls.items():
        if "pixel_values" in golden.request(request).inputs:
            continue
        mask = request_mask(golden, request)
        for call in calls:
            x = _tokens(golden.tensor(hidden_states_key(point, call, module_name)), mask)
            x = x.to(torch_dtype) if x.is_floating_point() else x
            try:  # an empty forward context: MoE layers read theirs (no attention runs)
                with (
                    torch.no_grad(),
                    quiet(),
                    set_forward_context(
                        None, running.llm.llm_engine.vllm_config, num_tokens=int(x.shape[0])
                    ),
                ):
                    out = reference_output(module, module(x))
            except Exception as exc:  # the module needs more than its input: say what
                raise AloneUnsupported(
                    f"vLLM's {module_name} does not run alone on its input "
                    f"({type(exc).__name__}: {exc})"
                ) from None
            expected = golden.expected(call.outputs["0"])
            actual = out.detach().float().to(torch_dtype)
            if isinstance(expected, TensorStatistics):  # of the kept rows, row-major as here
                if actual.numel() == expected.numel:  # else the judge says the shapes differ
                    actual = actual.reshape(expected.shape)
            else:
                expected = _tokens(expected, mask)
            see(Observation(point.name, "0", request, actual, expected, finished=0))
            stream = _fused_residual(module, x, running)
            if stream is not None:  # the fused add of the stream and zeros gives the stream
                see(Observation(point.name, RESIDUAL, request, stream.to(torch_dtype), x,
                                finished=0, control_of=(point.name, "0")))  # fmt: skip


def _fused_residual(module: Any, x: Any, running: Running) -> Any:
    """A fused add + norm run alone on (the stream, zeros): the residual stream it returns,
    which must be the stream itself; None for modules that are not fused norms."""
    import torch
    from vllm.forward_context import set_forward_context

    if "norm" not in type(module).__name__.lower() or not x.is_floating_point():
        return None
    config = running.llm.llm_engine.vllm_config
    try:
        with torch.no_grad(), quiet(), set_forward_context(None, config):
            out = module(x.clone(), torch.zeros_like(x))
    except TypeError:  # a norm that takes no residual
        return None
    residual = residual_output(module, out)
    return None if residual is None else residual.detach().float()


def observe_residuals(
    see: See,
    served: Served,
    golden: GoldenSet,
    request: str,
    rows: list[tuple[str, int]],
    mapping: list[PointMap],
    torch_dtype: Any,
) -> None:
    """Each fused add + norm's residual stream beside the reference norm's input (the stream
    entering it), handed to ``see`` to be judged within the accumulated budget of the block
    that holds the norm (the stream's error at that depth: ``control_of``); norms outside a
    captured block are not observed so."""
    points = {p.name for p in golden.points}
    for pm in mapping:
        parent = pm.point.rpartition(".")[0]
        name = f"{pm.module}.{RESIDUAL}"
        if pm.module is None or parent not in points or (rows[0][0], name) not in served.chunks:
            continue
        calls = golden.point(pm.point).calls.get(request)
        if not calls:
            continue
        key = calls[0].args[0] if calls[0].args and calls[0].args[0] is not None else None
        if not isinstance(key, str):
            continue
        expected = expected_at(golden, key, request_mask(golden, request))
        actual = prompt_rows(served, rows, name).to(torch_dtype)
        see(Observation(pm.point, RESIDUAL, request, actual, expected,
                        finished=served.order.get(name, 0), control_of=(parent, "0")))  # fmt: skip


class _LogitsOf:
    """vLLM's logits computation as a module-like callable (its ``lm_head`` is never called:
    the logits processor applies the head's weight)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def named_modules(self) -> Iterator[tuple[str, Any]]:
        return iter(())

    def __call__(self, hidden: Any) -> Any:
        return self.model.compute_logits(hidden)


def _tokens(tensor: Any, mask: Any) -> Any:
    """A golden input as vLLM's flattened tokens: the kept positions of [batch, seq, ...]
    (token ids [batch, seq] too), rows one after another; without a mask (a probe's
    [1, rows, hidden]) every row."""
    if mask is None:
        return tensor.flatten(0, -2) if tensor.dim() > 2 else tensor
    if tensor.dim() == 2 and tuple(tensor.shape) == tuple(mask.shape):
        return tensor[mask.bool()]
    return kept_positions(tensor, mask)
