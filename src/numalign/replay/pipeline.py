"""Pipeline-parallel replay (``--pp N``): each rank of a ``torch.distributed`` group holds a
contiguous range of the model's decoder layers, and the activations pass rank to rank.

The ranks are the ones tensor-parallel replay launches (``replay.tensor_parallel``: torchrun
beside pytest, a call every rank runs, rank 0's result back). Each rank builds the model as a
streamed one (``golden.stream``: every parameter on meta, the buffers real) and holds the
weights of its own **stage** only, read from the checkpoint once for the model's life (with
``--stream`` too, read as each unit runs): rank 0 the embedding and the first layers, the
last rank the last layers, the final norm and the LM head; the layers split as evenly as
they divide, and where they do not, as vLLM splits them (``pipeline_split.split_layers``).

Every rank runs the model's own forward, the same on all: a unit it does not hold runs a
stand-in in its place, so the model's own code between the units (masks, rotary
embeddings, the decoder loop, soft-capping) runs unchanged everywhere.

- The embedding on a rank after the first gives zeros of its output's shape; the layers
  before a rank's own pass their input on untouched.
- A rank after the first receives the hidden states its predecessor's last layer returned
  in place of its first layer's input (``replay.wire``: a header with the tensor's dtype
  and shape, its bytes, their checksum); a rank before the last sends its last layer's
  output on. Hidden states whose checksum on arrival is not the one sent are a
  :class:`BoundaryFault`: the input at fault of a divergence on that rank or after it.
- The layers after a rank's own and the final norm pass their input on; the LM head's output
  (the logits) is broadcast from the last rank, so every rank holds the model's own logits
  and makes the same decisions on them (a continuation, a decode step's next input).
- A layer a rank does not hold keeps its place in a KV cache: it appends a one per
  position (heads and dimension 1), so the cache's lengths, masks and positions on every
  rank are the model's.

Each rank observes the capture points of its own stage (``Stage.observes``: a point inside a
unit by that unit's rank; a point holding units, the model itself, by the rank of the last;
any other, a rotary embedding or a mask, by rank 0), judges them with the one judge, and the
ranks' results are merged in the order one process would have judged them
(``Stage.merged``); locating a divergence replays a point alone on the rank that holds it
(``StageAlone``). The verdicts are those of one process: the same kernels on the same
inputs (``tests/replay/test_pipeline_parallel.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from numalign.compare.calibration import CACHE_POINT, OUTPUT_POINT
from numalign.replay.pipeline_split import PipelineUnsupported, depth_of, split_layers
from numalign.replay.wire import broadcast_tensor, digest, receive_tensor, send_tensor

if TYPE_CHECKING:
    from numalign.compare.model_verdict import PointResult

T = TypeVar("T")


@dataclass
class Stage:
    """One rank's share of a pipelined model: which units (``golden.stream.units_of``) each
    rank holds, the decoder layers' units in order, and the LM head's unit."""

    rank: int
    ranks: int
    #: unit name -> the rank holding it, in the model's own order of units
    owner: dict[str, int]
    #: the decoder layers' units, in order (their index is the KV cache's layer index)
    layers: tuple[str, ...]
    head: str
    device: Any = None
    #: The whole model's forward is running (the boundaries pass activations then only;
    #: a unit replayed alone on its rank passes nothing on)
    flowing: bool = False
    #: What arrived at this rank changed on the way, since :meth:`start` (``wire.digest``)
    faults: list[BoundaryFault] = field(default_factory=list)
    #: Every rank's faults, gathered by :meth:`merged`
    all_faults: list[BoundaryFault] = field(default_factory=list)
    _points: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    @property
    def last(self) -> int:
        return self.ranks - 1

    def start(self) -> None:
        """A replay starts: the faults seen before it are not its own."""
        self.faults.clear()
        self.all_faults.clear()

    def owner_of(self, point: str) -> int:
        """The rank that observes ``point`` (module doc)."""
        if point not in self._points:
            holding = [u for u in self.owner if point == u or point.startswith(f"{u}.")]
            inside = [u for u in self.owner if not point or u.startswith(f"{point}.")]
            if holding:
                rank = self.owner[max(holding, key=len)]
            elif inside:
                rank = self.owner[inside[-1]]
            else:
                rank = 0
            self._points[point] = rank
        return self._points[point]

    def observes(self, point: str, path: str) -> bool:
        """Whether this rank judges ``point``'s output ``path``: the logits everywhere (every
        rank holds them), a cache state by the rank holding its layer, a point by its
        owner."""
        if point == OUTPUT_POINT:
            return True
        if point == CACHE_POINT:
            index = int(path.split(".")[1])
            return self.owner[self.layers[index]] == self.rank
        return self.owner_of(point) == self.rank

    def from_owner(self, point: str, compute: Callable[[], T]) -> T:
        """``compute()`` on the rank that holds ``point``, its result (or what it raised)
        on every rank."""
        import torch.distributed as dist

        source = self.owner_of(point)
        outcome: list[Any] = [None]
        if self.rank == source:
            try:
                outcome = [("ok", compute())]
            except Exception as exc:  # raised on every rank, as one process would
                outcome = [("raised", exc)]
        dist.broadcast_object_list(outcome, src=source)
        kind, value = outcome[0]
        if kind == "raised":
            raise value
        result: T = value
        return result

    def merged(
        self,
        points: list[PointResult],
        pooled: list[PointResult],
        key: Callable[[PointResult], tuple[Any, ...]],
    ) -> tuple[list[PointResult], list[PointResult]]:
        """Every rank's judged points and pooled leans (of the logits, which every rank
        judges, the last rank's), on every rank, in the order one process judges them: by
        ``key`` (the request, in decode the step), then by rank (the stages run in rank
        order), then as the rank judged them; each result's ``finished`` renumbered to its
        place in that order (a pooled lean's to its first result's)."""
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.ranks
        dist.all_gather_object(everyone, (points, pooled, self.faults))
        self.all_faults = [f for *_, faults in everyone for f in faults]

        def own(rank: int, result: PointResult) -> bool:  # the logits: the last rank's
            return result.point != OUTPUT_POINT or rank == self.last

        tagged = sorted(
            ((key(p), rank, p.finished, p)
             for rank, (ps, *_) in enumerate(everyone) for p in ps if own(rank, p)),
            key=lambda t: t[:3],
        )  # fmt: skip
        place = {(rank, finished): i for i, (_, rank, finished, _) in enumerate(tagged)}
        out = [replace(p, finished=i) for i, (*_, p) in enumerate(tagged)]
        leans = [
            replace(p, finished=place.get((rank, p.finished), p.finished))
            for rank, (_, ps, _) in enumerate(everyone)
            for p in ps
            if own(rank, p)
        ]
        return out, sorted(leans, key=lambda p: p.finished)


@dataclass(frozen=True)
class BoundaryFault:
    """Hidden states that changed between two ranks: what ``receiver`` got from ``sender``
    at ``layer`` (the receiver's first) is not what the sender's last layer returned."""

    sender: int
    receiver: int
    layer: str

    @property
    def input(self) -> tuple[str, str]:
        """The fault as ``compare.locate`` names an input at fault."""
        return (
            f"hidden states {self.layer} received from pipeline rank {self.sender}",
            f"changed on the way from rank {self.sender} to rank {self.receiver}: their "
            "checksum on arrival is not the one sent, a fault of the transport between the "
            "ranks",
        )


def stage_of(model: Any) -> Stage | None:
    """The model's pipeline stage (None: not a pipelined model)."""
    return getattr(model, "numalign_stage", None)


@dataclass
class StageAlone:
    """A replay's ``compare.locate.Alone`` on a pipelined model: each point replayed alone
    on the rank that holds it, its results on every rank."""

    inner: Any
    stage: Stage

    def replay_alone(self, point: str) -> list[PointResult]:
        return self.stage.from_owner(point, lambda: self.inner.replay_alone(point))

    def inputs_at_fault(self, failing: PointResult) -> Any:
        """The point's faulty inputs: hidden states that changed on the way to the point's
        rank or a rank before it (:class:`BoundaryFault`), else as one process judges them,
        on the point's rank; the model's forward that feeds them runs on every rank (the
        activations pass through every stage)."""
        owner = self.stage.owner_of(failing.point)
        faults = [f for f in self.stage.all_faults if f.receiver <= owner]
        if faults:
            return tuple(dict.fromkeys(f.input for f in faults))
        if owner != self.stage.rank:
            self.inner.feed(failing)
        return self.stage.from_owner(failing.point, lambda: self.inner.inputs_at_fault(failing))


@dataclass
class StageRanks:
    """A pipelined model's ranks as the judge sees them (``compare.model_judge.Ranks``): every
    rank's results merged in the order one process judges them (by ``key``: the request, in
    decode the step), each point replayed alone on the rank that holds it."""

    stage: Stage
    key: Callable[[PointResult], tuple[Any, ...]]

    def merged(
        self, points: list[PointResult], pooled: list[PointResult]
    ) -> tuple[list[PointResult], list[PointResult]]:
        return self.stage.merged(points, pooled, self.key)

    def alone(self, inner: Any) -> StageAlone:
        return StageAlone(inner, self.stage)


def load_stage(
    model_dir: str | Path,
    dtype: str,
    device: Any,
    *,
    attn_implementation: str | None = None,
    experts_implementation: str | None = None,
    stream: bool = False,
    rank: int | None = None,
    ranks: int | None = None,
) -> Any:
    """Stage ``rank`` of ``ranks`` of the model (module doc; None: this process's rank in its
    group): the streamed model with the stage's units held (``stream``: read as they run)
    and stand-ins for the others; ``model.numalign_stage`` is its :class:`Stage`. Its
    forward needs the ranks' process group."""
    import torch.distributed as dist

    from numalign.golden.stream import load_streamed

    model = load_streamed(model_dir, dtype, device, attn_implementation=attn_implementation,
                          experts_implementation=experts_implementation)  # fmt: skip
    rank = dist.get_rank() if rank is None else rank
    stage = _plan(model, rank, dist.get_world_size() if ranks is None else ranks)
    stage.device = model.numalign_streamer.device
    streamer = model.numalign_streamer
    for unit, holder in stage.owner.items():
        if holder != stage.rank:
            streamer.units[unit] = ()  # never read here
        elif not stream:
            streamer.enter(unit)  # read once, held for the model's life
    _stand_ins(model, stage)
    _boundaries(model, stage)
    model.numalign_stage = stage
    return model


def _plan(model: Any, rank: int, ranks: int) -> Stage:
    """Which rank holds which unit: the decoder layers split by :func:`split_layers`, the
    units before them (embeddings) on rank 0, the ones after them (the final norm, the
    head) on the last rank."""
    units = list(model.numalign_streamer.units)
    layers = _decoder_layers(model, units)
    head_module = model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    head = names.get(id(head_module), "")
    if head not in units:
        raise PipelineUnsupported(f"{type(model).__name__} has no LM head a stage can hold")
    first, last = units.index(layers[0]), units.index(layers[-1])
    if units[first : last + 1] != list(layers):
        between = [u for u in units[first : last + 1] if u not in layers]
        raise PipelineUnsupported(
            f"{type(model).__name__}'s weights between its decoder layers ({', '.join(between)}) "
            "belong to no stage"
        )
    owner = dict.fromkeys(units[:first], 0)
    for stage_rank, indices in enumerate(split_layers(len(layers), ranks)):
        owner.update(dict.fromkeys((layers[i] for i in indices), stage_rank))
    owner.update(dict.fromkeys(units[last + 1 :], ranks - 1))
    return Stage(rank, ranks, {u: owner[u] for u in units}, layers, head)


def _decoder_layers(model: Any, units: list[str]) -> tuple[str, ...]:
    """The units of the model's decoder layers: the one ``ModuleList`` of units as long as
    the config's depth."""
    import torch

    depth = depth_of(model.config)
    found = [
        tuple(f"{name}.{i}" for i in range(len(module)))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == depth
        and all(f"{name}.{i}" in units for i in range(len(module)))
    ]  # fmt: skip
    if len(found) != 1:
        raise PipelineUnsupported(
            f"{type(model).__name__}: found {len(found)} lists of {depth} decoder layers, "
            "not one to split over the ranks"
        )
    return found[0]


def _stand_ins(model: Any, stage: Stage) -> None:
    """Each unit another rank holds runs a stand-in (module doc)."""
    import torch

    first = stage.owner[stage.layers[0]] if stage.layers else 0
    seen_layers = False
    for unit, rank in stage.owner.items():
        seen_layers = seen_layers or unit in stage.layers
        if rank == stage.rank:
            continue
        module = model.get_submodule(unit)
        stand_in: Callable[..., Any]
        if unit in stage.layers:
            stand_in = functools.partial(_layer_stand_in, stage.layers.index(unit))
        elif unit == stage.head:
            stand_in = functools.partial(_receive_logits, stage)
        elif seen_layers:  # the final norm
            stand_in = _passed_on
        elif isinstance(module, torch.nn.Embedding):
            stand_in = functools.partial(_zeros_embedding, module)
        else:
            raise PipelineUnsupported(
                f"{type(model).__name__}'s {unit} runs before the decoder layers and is not an "
                f"embedding: rank {first} cannot stand in for it on the other ranks"
            )
        module.forward = stand_in  # the hooks (the boundaries, streaming) still run


def _boundaries(model: Any, stage: Stage) -> None:
    """Hooks on this rank's first and last layer that receive and send the hidden states,
    and on the LM head of the last rank that broadcasts the logits, while the whole model's
    forward runs (``Stage.flowing``)."""

    def flowing(value: bool) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            stage.flowing = value

        return hook

    model.register_forward_pre_hook(flowing(True))
    model.register_forward_hook(flowing(False), always_call=True)
    mine = [u for u in stage.layers if stage.owner[u] == stage.rank]
    if stage.rank > 0:

        def receive(_: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
            import torch
            import torch.distributed as dist

            if not stage.flowing:
                return None
            hidden = receive_tensor(stage.rank - 1, stage.device)
            sent = torch.empty(1, dtype=torch.int64, device=stage.device)
            dist.recv(sent, stage.rank - 1)
            if int(sent) != int(digest(hidden)):
                stage.faults.append(BoundaryFault(stage.rank - 1, stage.rank, mine[0]))
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        model.get_submodule(mine[0]).register_forward_pre_hook(
            receive, with_kwargs=True, prepend=True
        )
    if stage.rank < stage.last:

        def send(_: Any, __: Any, output: Any) -> None:
            import torch.distributed as dist

            if stage.flowing:
                hidden = output if not isinstance(output, tuple) else output[0]
                send_tensor(hidden, stage.rank + 1)
                dist.send(digest(hidden), stage.rank + 1)  # checked on arrival

        model.get_submodule(mine[-1]).register_forward_hook(send)
    else:

        def broadcast(_: Any, __: Any, output: Any) -> None:
            if stage.flowing:
                broadcast_tensor(output, stage.last, stage.device)

        model.get_submodule(stage.head).register_forward_hook(broadcast)


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs["hidden_states"]


def _layer_stand_in(index: int, *args: Any, **kwargs: Any) -> Any:
    """A decoder layer another rank holds: its input passed on; in a KV cache, its place
    kept where the cache counts positions by it (a one per position, heads and dimension 1:
    a static layer counts the positions it holds as those not all zero). A linear-attention
    layer's states are left as they are: the cache counts positions by its attention layers,
    and only the rank holding the layer reads its states."""
    from transformers.cache_utils import Cache

    hidden = _hidden(args, kwargs)
    # by keyword, or by place (GPT-2's blocks take it second)
    cache = next((a for a in (*args[1:], *kwargs.values()) if isinstance(a, Cache)), None)
    if cache is not None and _counts_positions(cache, index):
        filler = hidden.new_ones(hidden.shape[0], 1, hidden.shape[1], 1)
        cache.update(filler, filler, index)
    return hidden


def _counts_positions(cache: Any, index: int) -> bool:
    """Whether layer ``index`` of ``cache`` holds keys and values (an attention layer's, or a
    layer not made yet, which an update makes); False for a linear-attention layer's
    states alone."""
    layers = getattr(cache, "layers", None)
    if layers is None or index >= len(layers):
        return True
    return hasattr(layers[index], "keys")


def _passed_on(*args: Any, **kwargs: Any) -> Any:
    return _hidden(args, kwargs)


def _zeros_embedding(module: Any, ids: Any, *_: Any, **__: Any) -> Any:
    import torch

    return torch.zeros(*ids.shape, module.embedding_dim, dtype=module.weight.dtype,
                       device=ids.device)  # fmt: skip


def _receive_logits(stage: Stage, *_: Any, **__: Any) -> Any:
    return broadcast_tensor(None, stage.last, stage.device)
