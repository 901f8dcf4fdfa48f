"""Streaming an MoE layer by expert: only the experts its tokens route to are read and
materialized (``--stream``), so a layer whose experts do not fit in memory together (a
trillion-parameter model's: hundreds of experts a layer) still runs.

transformers keeps a layer's experts fused, one 3-D parameter per projection
(``gate_up_proj`` ``[experts, 2 x intermediate, hidden]``, ``down_proj``), which its weight
converters build from the checkpoint's per-expert tensors (``experts.{i}.gate_proj.weight``
and the like). A streamed experts module keeps those parameters on meta; when it is called
with the router's choice (``top_k_index``), the experts chosen are read from the checkpoint,
renumbered 0..k-1 in their own order, and converted by the same converters into fused
parameters of k experts; the module runs its own experts implementation (eager, grouped_mm,
batched_mm) on them with the router's indices renumbered the same way, and the parameters go
back to meta. The renumbering keeps the experts' order, so every implementation groups and
sums the same tokens in the same order as on the full parameters: the outputs are bitwise
the unstreamed ones (tests/golden/test_streamed_capture.py, tests/replay/test_stream.py).

An experts module is streamed this way where its checkpoint holds one tensor per expert
(``.experts.{i}.``); a checkpoint that stores the experts already fused loads them whole with
the rest of its layer.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Protocol

#: The expert's number in a checkpoint key (``...mlp.experts.7.gate_proj.weight``).
EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")


class Streamer(Protocol):
    """What this module asks of ``golden.stream.Streamer`` (it sits below it)."""

    model: Any

    def read(self, keys: list[str]) -> dict[str, Any]: ...
    def convert(self, state: dict[str, Any]) -> None: ...
    def hold(self, nbytes: int) -> None: ...
    def check_loaded(self, names: list[str], what: str) -> None: ...


@dataclass(frozen=True)
class RoutedExperts:
    """An experts module streamed by expert: its name, its fused parameters' names, how many
    experts it has, and per parameter and expert the checkpoint tensors it is made of."""

    name: str
    params: tuple[str, ...]
    count: int
    keys: dict[str, dict[int, tuple[str, ...]]]


def find_routed(model: Any, sources: dict[str, tuple[str, ...]]) -> dict[str, RoutedExperts]:
    """The experts modules of ``model`` that can stream by expert: a ``num_experts``, every
    parameter of its own fused over the experts (first dimension ``num_experts``), a forward
    that takes the router's ``top_k_index``, and checkpoint tensors one per expert."""
    found = {}
    for name, module in model.named_modules():
        count = getattr(module, "num_experts", None)
        params = dict(module.named_parameters(recurse=False))
        if not isinstance(count, int) or count < 1 or not params:
            continue
        if "top_k_index" not in inspect.signature(module.forward).parameters:
            continue
        if any(p.dim() < 2 or p.shape[0] != count for p in params.values()):
            continue
        keys = {}
        for param in params:
            full = f"{name}.{param}"
            by_expert: dict[int, list[str]] = {}
            for key in sources.get(full, ()):
                match = EXPERT_KEY.search(key)
                if match is None:
                    break
                by_expert.setdefault(int(match.group(1)), []).append(key)
            else:
                if sorted(by_expert) == list(range(count)):
                    keys[full] = {i: tuple(k) for i, k in by_expert.items()}
        if len(keys) == len(params):
            found[name] = RoutedExperts(name, tuple(keys), count, keys)
    return found


def stream_by_expert(streamer: Streamer, experts: RoutedExperts) -> None:
    """Replaces the module's forward (on the instance: its hooks still run around it) with
    one that materializes only the experts routed to."""
    import torch

    module = streamer.model.get_submodule(experts.name)
    forward = module.forward

    def routed(hidden_states: Any, top_k_index: Any, top_k_weights: Any, *args: Any,
               **kwargs: Any) -> Any:  # fmt: skip
        chosen = top_k_index[(top_k_index >= 0) & (top_k_index < experts.count)]
        hit = torch.unique(chosen).tolist()  # sorted: the experts keep their order
        if not hit:
            return torch.zeros_like(hidden_states)
        # an index past the experts (a dropped slot) stays past them: k
        renumber = torch.full((experts.count + 1,), len(hit), dtype=top_k_index.dtype,
                              device=top_k_index.device)  # fmt: skip
        renumber[hit] = torch.arange(len(hit), dtype=top_k_index.dtype, device=renumber.device)
        _load(streamer, experts, module, hit)
        try:
            return forward(hidden_states, renumber[top_k_index], top_k_weights, *args, **kwargs)
        finally:
            _unload(streamer, experts, module)

    # what it reads depends on the router's choice: a compiled layer runs it eager (a graph
    # break), the weights read outside any graph
    module.forward = torch.compiler.disable(  # type: ignore[no-untyped-call]
        routed, reason="an MoE layer's experts streamed by expert read the experts routed to"
    )


def _load(streamer: Streamer, experts: RoutedExperts, module: Any, hit: list[int]) -> None:
    """The experts ``hit`` as the module's parameters, fused over them alone, numbered in
    their order, converted by transformers' own converters; ``num_experts`` their count."""
    import torch

    renamed = {}
    for new, old in enumerate(hit):
        for param in experts.params:
            for key in experts.keys[param][old]:
                renamed[key] = EXPERT_KEY.sub(f".experts.{new}.", key, count=1)
    state = {renamed[k]: t for k, t in streamer.read(sorted(renamed)).items()}
    for param in experts.params:
        attr = param.rpartition(".")[2]
        shape = (len(hit), *module._parameters[attr].shape[1:])
        module._parameters[attr] = torch.nn.Parameter(
            torch.empty(shape, dtype=module._parameters[attr].dtype, device="meta"),
            requires_grad=False,
        )
    module.num_experts = len(hit)
    streamer.convert(state)
    streamer.check_loaded(list(experts.params), f"the experts {hit} of {experts.name}")
    streamer.hold(sum(module._parameters[p.rpartition(".")[2]].nbytes for p in experts.params))


def _unload(streamer: Streamer, experts: RoutedExperts, module: Any) -> None:
    """The module's parameters back on meta at their full number of experts."""
    import torch

    freed = 0
    for param in experts.params:
        attr = param.rpartition(".")[2]
        current = module._parameters[attr]
        freed += current.nbytes
        module._parameters[attr] = torch.nn.Parameter(
            torch.empty((experts.count, *current.shape[1:]), dtype=current.dtype, device="meta"),
            requires_grad=False,
        )
    module.num_experts = experts.count
    streamer.hold(-freed)
