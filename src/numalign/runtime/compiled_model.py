"""Compiled models (``--compile`` in the model suites): the whole model compiled, and each
capture point's module compiled alone for layer replay; the decisions shared with the
compiled operators are ``runtime.compiled``'s (observed by taps, compiled once per worker,
never silently eager, compile time apart from run time). Here besides:

- **A streamed model compiles by region.** A model whose weights stream (``--stream``, and
  a pipeline rank's stage: ``golden.stream``) holds real weights only while a unit runs, and
  its streaming hooks read the checkpoint: no whole-model graph can hold it. Each unit's own
  forward (a decoder layer, the embedding, the final norm, the LM head) is compiled on its
  own (regional compilation, as deployments of large models compile their repeated blocks):
  the unit's hooks run eager around its compiled forward, so its weights are there when the
  graph runs, and the model's code between the units (masks, rotary embeddings, the decoder
  loop) runs eager. Each layer compiles once: its hooks (the taps naming its points) are
  constants of its graph, as they are inside a whole-model graph. The streaming hooks of the
  modules inside a unit do nothing while Dynamo traces (the unit holds their weights); an
  MoE layer's experts streamed by expert load what the router chose, a data-dependent read:
  they run eager, a graph break the records count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from numalign.runtime.compiled import (
    RECOMPILE_LIMIT,
    SHARED_RECOMPILE_LIMIT,
    CompileSpec,
    CompileStats,
    configure_dynamo,
    run_compiled,
)

if TYPE_CHECKING:
    import torch


class CompiledModel:
    """A model and its compiled forms: the whole model compiled (calling this object), and
    each capture point's module compiled alone (:meth:`get_submodule`).

    Everything else (``config``, ``forward``'s signature, ``named_modules``) is the eager
    model's. Tap hooks on the capture points, installed before anything is compiled, append
    ``(point, output)`` to ``taps``; ``numalign.replay.observe`` turns them into the
    comparisons eager replay makes with its hooks."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: CompileSpec,
        points: Sequence[str],
        prepare: Callable[[torch.nn.Module], None] | None = None,
    ) -> None:
        import torch

        configure_dynamo()
        self.model = model
        self.spec = spec
        self.stats = CompileStats()
        self.taps: list[tuple[str, Any]] = []
        for name in points:
            model.get_submodule(name).register_forward_hook(self._tap(name))
        #: a streamed model's units, each compiled alone (module doc), its streamer, and
        #: what runs eager on a unit's weights before a graph of it runs
        self.streamer = getattr(model, "numalign_streamer", None)
        self.regions = streamed_units(self.streamer)
        self.prepare = prepare
        self._compiled: Callable[..., Any] = model
        if self.regions:
            for unit in self.regions:
                _compile_region(model.get_submodule(unit), spec, prepare)
        else:
            self._compiled = torch.compile(  # type: ignore[call-overload]
                model, backend=spec.backend, mode=spec.mode, dynamic=None,
                recompile_limit=RECOMPILE_LIMIT, isolate_recompiles=True,
            )  # fmt: skip
        self._modules: dict[str, Callable[..., Any]] = {}

    def _tap(self, point: str) -> Callable[..., None]:
        taps = self.taps

        def tap(module: Any, args: Any, output: Any) -> None:
            taps.append((point, output))

        return tap

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["model"], name)

    def __call__(self, **inputs: Any) -> Any:
        """The compiled model on ``inputs``; tensors' batch and sequence dimensions are
        marked dynamic first (where the model specialises them anyway, Dynamo keeps them
        static: ``maybe_mark_dynamic`` never raises)."""
        __tracebackhide__ = True
        import torch

        for value in inputs.values():
            if isinstance(value, torch.Tensor):
                for dim in range(min(2, value.dim())):
                    torch._dynamo.maybe_mark_dynamic(value, dim)
        self.taps.clear()
        what = type(self.model).__name__
        what += " (each unit compiled)" if self.regions else " (whole model)"
        return run_compiled(self._compiled, self.spec, what, self.stats, **inputs)

    def get_submodule(self, target: str) -> Callable[..., Any]:
        """The module at ``target`` compiled alone (once per model), for layer replay. In a
        streamed model, a module inside a unit is compiled alone and runs with its unit's
        weights held; any other (a unit, a module holding units, code between them such as
        a rotary embedding) is its eager module, as it runs in the model, its units
        compiled."""
        if target not in self._modules:
            import torch

            module = self.model.get_submodule(target)
            unit = next((u for u in self.regions if target.startswith(f"{u}.")), None)
            if self.regions and unit is None:
                self._modules[target] = _CompiledPoint(self, module, target)
                return self._modules[target]
            compiled = torch.compile(  # type: ignore[call-overload]
                module, backend=self.spec.backend, mode=self.spec.mode, dynamic=None,
                recompile_limit=SHARED_RECOMPILE_LIMIT,
            )  # fmt: skip
            self._modules[target] = _CompiledPoint(self, compiled, target, unit)
        return self._modules[target]


def streamed_units(streamer: Any) -> tuple[str, ...]:
    """The units of a streamed model (its ``golden.stream.Streamer``) whose weights this
    process holds or reads (a pipeline rank's own: the others' run stand-ins); none for a
    model that does not stream (None)."""
    if streamer is None:
        return ()
    return tuple(unit for unit, params in streamer.units.items() if params)


def _compile_region(
    module: torch.nn.Module, spec: CompileSpec, prepare: Callable[[torch.nn.Module], None] | None
) -> None:
    """``module``'s forward replaced by its compiled form, on the instance: ``Module.__call__``
    still runs its hooks (the streaming's, a pipeline's boundaries, the taps) eager around it;
    ``prepare(module)`` runs eager before each call, its weights there (a kernel swap settles
    on them)."""
    import torch

    compiled = torch.compile(  # type: ignore[call-overload]
        module.forward, backend=spec.backend, mode=spec.mode, dynamic=None,
        recompile_limit=SHARED_RECOMPILE_LIMIT,
    )  # fmt: skip
    if prepare is None:
        module.forward = compiled
        return

    def forward(*args: Any, **kwargs: Any) -> Any:
        prepare(module)
        return compiled(*args, **kwargs)

    module.forward = forward


@dataclass
class _CompiledPoint:
    """One capture point's module compiled alone; calls add to the model's stats."""

    owner: CompiledModel
    compiled: Callable[..., Any]
    name: str
    #: a streamed model's point inside a unit: the unit whose weights it holds around the
    #: compiled call (the streaming hooks inside it do nothing while Dynamo traces)
    unit: str | None = None

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The point's module's parameters (what ``replay.layer.input_dtype`` reads)."""
        return self.owner.model.get_submodule(self.name).parameters()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        owner = self.owner
        streamer = owner.streamer if self.unit is not None else None
        if streamer is not None:
            streamer.enter(self.unit)
            if owner.prepare is not None:
                owner.prepare(owner.model.get_submodule(self.name))
        try:
            return run_compiled(self.compiled, owner.spec, self.name, owner.stats, *args, **kwargs)
        finally:
            owner.taps.clear()  # the point's own taps (and its children's) are not compared
            if streamer is not None:
                streamer.exit(self.unit)


def compile_model(
    model: Any,
    spec: CompileSpec,
    points: Sequence[str],
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> CompiledModel:
    """``model`` with its compiled forms (nothing compiles until the first call);
    ``prepare``: what a streamed model's unit runs eager before its compiled forward."""
    return CompiledModel(model, spec, points, prepare)


def take_stats(model: Any) -> CompileStats | None:
    """What compiling ``model`` cost since the last take (None: not compiled); for the
    handle on a model tensor-parallel or pipeline ranks hold, what they reported."""
    if isinstance(model, CompiledModel):
        return model.stats.take()
    ranks = getattr(model, "compile_stats", None)
    return ranks.take() if isinstance(ranks, CompileStats) else None


def of_ranks(spent: Sequence[CompileStats | None]) -> CompileStats | None:
    """What compiling cost a call that every rank ran (None: nothing compiled): the slowest
    rank's compile time (they compile at once), the most graph breaks one rank's code had,
    every rank's reasons."""
    seen = [s for s in spent if s is not None]
    if not seen:
        return None
    reasons = list(dict.fromkeys(r for s in seen for r in s.reasons))
    return CompileStats(max(s.compile_s for s in seen), max(s.graph_breaks for s in seen), reasons)
