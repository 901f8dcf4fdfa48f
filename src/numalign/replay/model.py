"""Model replay over a golden set: layer replay (each point alone, fed the golden inputs,
against the isolated calibration) and full-model replay (every point as the whole model runs,
against the accumulated calibration), the model's own outputs (logits, or an encoder's hidden
states), the greedy continuation, and the first divergence, located: the transformers
engine's observations (``observe_layer``, ``observe_model``) handed to the one judge
(``compare.model_judge``), which gives the verdicts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from numalign.compare import CompareResult
from numalign.compare.exact import LeftOut
from numalign.compare.model_verdict import ModelVerdict, PointResult, ReplayUnsupported
from numalign.core import dtypes
from numalign.core.observation import ContinuationRun, Event, FinalOutput, Observation
from numalign.core.statistics import Expected, TensorStatistics
from numalign.golden.positions import kept_positions
from numalign.golden.reference import (
    append_token,
    forward_kwargs,
    greedy_step,
    load_model,
    model_outputs,
)
from numalign.replay.inputs import fed_inputs, input_at_fault
from numalign.replay.judging import judged_layer, judged_model
from numalign.replay.layer import (
    AloneUnsupported,
    left_out,
    replay_call,
    request_mask,
)
from numalign.replay.observe import observe
from numalign.replay.pipeline import StageRanks, stage_of
from numalign.replay.pipeline_split import depth_of
from numalign.replay.sets import open_fresh
from numalign.replay.shards import whole
from numalign.runtime.compiled import CompileStats
from numalign.runtime.compiled_model import compile_model, of_ranks, take_stats
from numalign.runtime.variant import Variant

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet, Point
    from numalign.replay.tensor_parallel import RankAnswer, RankGroup, ShardedModel
    from numalign.session.settings import Settings

T = TypeVar("T")


def check_dtype(golden: GoldenSet, dtype: str | None) -> None:
    """ReplayUnsupported where the reference's own code could not run in ``dtype`` at
    calibration (``Manifest.dtype_limits``): no replay in it can be judged, so none is run."""
    limit = golden.manifest.dtype_limits.get(dtype or "")
    if limit is not None:
        raise ReplayUnsupported(
            f"the reference itself could not run in {dtype} at capture, a limit of the "
            f"model's code, not of this candidate or device: {limit}"
        )


def hidden_and_depth(model: Any = None, *, config: Any = None) -> tuple[int, int]:
    """The hidden size and depth (layers) a control's reduction length is built from
    (``control_for``), of ``model``'s config or of ``config`` itself (a set's power is
    computed without loading the model: ``replay.set_power``); 1 for what the config does
    not name."""
    config = model.config if config is None else config
    depth = depth_of(config)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 1
    return int(hidden), depth


@dataclass
class ModelCache:
    """Models loaded once per worker per set and :class:`~numalign.runtime.variant.Variant`
    (device, dtype, attention and experts implementations, swaps, compile variant, tensor
    parallel; the decode's cache is not part of it: one model serves every cache); a compiled
    model is a ``CompiledModel`` (``numalign.runtime.compiled_model``). Under ``--tp N`` a model
    is a ``ShardedModel``, held by this worker's tensor-parallel ranks, each of which keeps
    its own cache with ``sharded`` set (it loads its shard with transformers' ``tp_plan``);
    replays reach either kind through ``run``."""

    models: dict[tuple[str, Variant], Any] = field(default_factory=dict)
    #: This cache is a rank's: models load sharded (``tp_plan="auto"``), or under ``--pp``
    #: as the rank's pipeline stage (``replay.pipeline``).
    sharded: bool = False
    groups: dict[Settings, RankGroup] = field(default_factory=dict)

    def get(self, golden: GoldenSet, variant: Variant) -> Any:
        """The set's model in ``variant`` (its device and dtype, its implementations, swaps
        and compile variant), loaded on first use."""
        # by default, the attention implementation the set was captured with
        attention = variant.attention or golden.reference.attn_implementation
        key = (str(golden.path), variant.with_changes(attention=attention, cache=None))
        check_dtype(golden, variant.dtype)
        if key not in self.models:
            self.models[key] = self._load(golden, key[1])
        return self.models[key]

    def _load(self, golden: GoldenSet, variant: Variant) -> Any:
        from numalign.replay.swap import SwapUnmatched, apply_swaps, parse_swaps, settle_within

        assert variant.dtype is not None, "a model loads in a dtype"
        try:
            model = self._weights(golden, variant)
            # swapped in place: a streamed or pipeline stage's modules keep their parameters'
            # names, which their loads read by (replay.swap.Swapped)
            apply_swaps(model, parse_swaps(variant.swaps))
            if variant.compile is not None:  # after the swaps: the compiler sees the kernels
                points = [p.name for p in golden.points]
                settle = settle_within if variant.swaps else None
                model = compile_model(model, variant.compile, points, settle)
        except SwapUnmatched as exc:  # another model of the session has the module
            raise ReplayUnsupported(str(exc)) from None
        except ValueError as exc:  # an implementation the model lacks
            if "implementation" not in str(exc):
                raise
            raise ReplayUnsupported(str(exc).split(". ")[0]) from None
        return model

    def _weights(self, golden: GoldenSet, variant: Variant) -> Any:
        """The set's model loaded as ``variant`` asks: this rank's stage of the layers
        (``--pp``, replay.pipeline), streamed one unit of weights at a time (``--stream``,
        golden.stream; under ``--tp`` each unit's shard), this rank's shard (``--tp``), or
        whole on the device."""
        assert variant.dtype is not None
        if variant.pp > 1:
            from numalign.replay.pipeline import load_stage

            return load_stage(
                golden.model_dir, variant.dtype, variant.device, stream=variant.stream,
                attn_implementation=variant.attention, experts_implementation=variant.experts,
            )  # fmt: skip
        if variant.stream:
            from numalign.golden.stream import load_streamed

            return load_streamed(
                golden.model_dir, variant.dtype, variant.device,
                attn_implementation=variant.attention, experts_implementation=variant.experts,
                tensor_parallel=self.sharded,  # each unit this rank's shard (--tp)
            )  # fmt: skip
        model = load_model(
            golden.model_dir, variant.dtype, attn_implementation=variant.attention,
            trust_remote_code=False, experts_implementation=variant.experts,
            tp_plan="auto" if self.sharded else None,
        )  # fmt: skip
        return model if self.sharded else model.to(variant.device)  # a shard is placed

    @staticmethod
    def record_context(
        golden: GoldenSet, variant: Variant, device: torch.device, model: Any = None
    ) -> dict[str, Any]:
        """The fields every record of a model-suite test shares (the variant's among them);
        for a compiled ``model``, what compiling cost this test (compile time and graph
        breaks, apart from run time)."""
        if variant.pp > 1:  # the records name the ranks' layers
            from numalign.replay.pipeline_split import check_pipelinable

            variant = replace(variant, pp_layout=check_pipelinable(golden.model_dir, variant.pp))
        context = {
            "suite": "models", "candidate": "transformers", "device": str(device),
            "golden_fingerprint": golden.model.fingerprint, "model": golden.name,
            **variant.record_fields(),
        }  # fmt: skip
        spent = take_stats(model) if model is not None else None
        return context | (spent.record_fields() if spent is not None else {})

    def load(
        self, path: str | Path, settings: Settings, device: torch.device, dtype: str
    ) -> tuple[GoldenSet, Any]:
        """The set, checked fresh (StaleGoldenSetError otherwise), and its model as the
        session's settings ask (``model_for``; under ``--tp`` or ``--pp``, held by the
        ranks)."""
        golden = open_fresh(path)
        check_dtype(golden, dtype)
        if (settings.tp > 1 or settings.pp > 1) and not self.sharded:
            return golden, self._sharded(golden, settings, dtype)
        return golden, self.model_for(golden, settings, device, dtype)

    def model_for(
        self,
        golden: GoldenSet,
        settings: Settings,
        device: torch.device,
        dtype: str,
        attn_implementation: str | None = None,
    ) -> Any:
        """The set's model as the session's settings ask (their variant); an
        ``attn_implementation`` overrides the settings' attention implementation."""
        variant = Variant.from_settings(settings, device=device, dtype=dtype)
        if attn_implementation:
            variant = variant.with_changes(attention=attn_implementation)
        return self.get(golden, variant)

    def _sharded(self, golden: GoldenSet, settings: Settings, dtype: str) -> ShardedModel:
        """The handle on the set's model held by this worker's group of ``settings.tp``
        ranks, or ``settings.pp`` pipeline ranks (started on first use; NoTensorParallelPlan,
        PipelineUnsupported, or a usage error naming the numbers when the model cannot be
        split that way)."""
        from numalign.replay.pipeline_split import check_pipelinable
        from numalign.replay.tensor_parallel import RankGroup, ShardedModel, check_shardable

        if settings.tp > 1:
            check_shardable(golden.model_dir, settings.tp)
        if settings.pp > 1:
            check_pipelinable(golden.model_dir, settings.pp)
        group = self.groups.get(settings)
        if group is None:
            ranks = settings.tp * settings.pp
            group = self.groups[settings] = RankGroup(ranks, settings, settings.tp_timeout)
        return ShardedModel(group, str(golden.path), dtype)

    @staticmethod
    def run(fn: Callable[..., T], golden: GoldenSet, model: Any, *args: Any) -> T:
        """``fn(golden, model, *args)``: here, or for a ``ShardedModel`` on every rank of its
        group (each with its shard and its own device in place of a ``torch.device``
        argument), rank 0's result. ``fn`` and ``args`` travel by pickle, between this
        process and its own ranks."""
        from numalign.replay.tensor_parallel import ShardedModel

        if isinstance(model, ShardedModel):
            answers = model.group.call_all(replay_on_rank, fn, model.path, model.dtype, args)
            spent = of_ranks([a.compile_stats for a in answers if a is not None])
            if spent is not None:
                model.compile_stats = model.compile_stats or CompileStats()
                model.compile_stats.add(spent)
            result: T = answers[0].result
            return result
        return fn(golden, model, *args)

    def close(self) -> None:
        """Stops this cache's tensor-parallel groups."""
        for group in self.groups.values():
            group.close()
        self.groups.clear()


def replay_on_rank(
    fn: Callable[..., T], path: str, dtype: str, args: tuple[Any, ...]
) -> RankAnswer:
    """``fn(golden, model, *args)`` on a tensor-parallel rank (``ModelCache.run`` sends it),
    and what compiling cost this rank in it (None: not compiled): the set at ``path``
    (opened once per rank while its manifest stays the same) and its model loaded sharded
    (once per rank, by the rank's cache; under ``--pp``, the rank's stage); a
    ``torch.device`` among ``args`` is replaced by the rank's device. On a pipeline rank, a
    replay of one point (a ``Point`` among ``args``) runs on the rank holding it and its
    result reaches every rank."""
    import torch

    from numalign.golden.store import Point
    from numalign.replay.tensor_parallel import RANK, RankAnswer, rank_device

    device = rank_device()
    golden = RANK.golden(path)  # the controller checked it fresh for this call
    model = RANK.cache.model_for(golden, RANK.settings, device, dtype)
    args = tuple(device if isinstance(a, torch.device) else a for a in args)
    stage = stage_of(model)
    point = next((a for a in args if isinstance(a, Point)), None)
    if stage is not None and point is not None:  # a replay of one point: on its rank
        result = stage.from_owner(point.name, lambda: fn(golden, model, *args))
    else:
        result = fn(golden, model, *args)
    return RankAnswer(result, take_stats(model))


def observe_layer(
    golden: GoldenSet,
    model: Any,
    point: Point,
    dtype: str,
    device: torch.device,
    see: Callable[[Observation], None],
) -> None:
    """Every recorded call of ``point`` run alone on its golden inputs, each output handed to
    ``see`` at the positions the request's mask keeps (faults in the others with it)."""
    module = model.get_submodule(point.name)
    for request, calls in point.calls.items():
        mask = request_mask(golden, request)
        for index, call in enumerate(calls):
            outputs = replay_call(
                module, golden, call, device=device, dtype=dtypes.torch_dtype(dtype)
            )
            for path, key in call.outputs.items():
                actual = outputs.get(path)
                if actual is None:  # e.g. attention weights, which only eager returns
                    continue
                truth = golden.expected(key)
                faults = None
                if isinstance(truth, TensorStatistics):  # of the kept positions already
                    expected: Expected = truth
                else:
                    expected = kept_positions(truth, mask)
                    faults = left_out(actual.detach(), truth, mask)
                # a tensor-parallel rank's shard gathered whole
                actual = whole(kept_positions(actual.detach(), mask), tuple(expected.shape))
                see(Observation(point.name, path, request, actual, expected, call=index,
                                left_out=faults))  # fmt: skip


def replay_layer(
    golden: GoldenSet,
    model: Any,
    point: Point,
    dtype: str,
    device: torch.device,
    policy: Any = None,
) -> list[PointResult]:
    """Every recorded call of ``point`` replayed alone; each output against the golden one
    within the isolated calibration's budget."""
    observe = partial(observe_layer, golden, model, point, dtype, device)
    return judged_layer(golden, dtype, hidden_and_depth(model), policy, observe).verdict


def observe_model(
    golden: GoldenSet, model: Any, dtype: str, device: torch.device, see: Callable[[Event], None]
) -> dict[str, str] | None:
    """The whole model on every golden request, handing ``see`` every capture point's
    outputs as the forward computes them (with the faults in the rows the request's mask
    leaves out), the model's own outputs, and its greedy continuation."""
    import torch

    torch_dtype = dtypes.torch_dtype(dtype)
    # faults in the rows a request's mask leaves out, judged with the point's own result
    pending: dict[tuple[str, str, str, int], LeftOut] = {}
    for request in golden.requests:
        name = request.name
        inputs = {
            k: golden.tensor(v, device=device, dtype=torch_dtype) for k, v in request.inputs.items()
        }

        def on_output(
            point: str, path: str, actual: Any, expected: Any, call: int, name: str = name
        ) -> None:
            actual = whole(actual, tuple(expected.shape))  # a tensor-parallel rank's shard
            faults = pending.pop((name, point, path, call), None)
            see(Observation(point, path, name, actual, expected, call=call, left_out=faults))

        def on_left_out(
            point: str, path: str, faults: LeftOut, call: int, name: str = name
        ) -> None:
            pending[(name, point, path, call)] = faults

        with torch.no_grad(), observe(model, golden, name, on_output, on_left_out):
            out = model(**inputs, **forward_kwargs(model))
        mask = request_mask(golden, name)
        finals = model_outputs(out)
        for output, key in golden.final_outputs(name).items():
            actual = kept_positions(finals[output].detach().float().cpu(), mask)
            expected = kept_positions(golden.tensor(key), mask)
            see(FinalOutput(name, output, whole(actual.to(torch_dtype), tuple(expected.shape)),
                            expected))  # fmt: skip
        continuation = golden.continuation(name)
        if continuation is not None:
            tokens = golden.tensor(continuation.tokens)
            steps = partial(greedy_steps, model, inputs, tokens)
            see(ContinuationRun(name, tokens, golden.tensor(continuation.logits), steps))
    return None  # the transformers engine has every point


def replay_model(
    golden: GoldenSet, model: Any, dtype: str, device: torch.device, policy: Any = None
) -> ModelVerdict:
    """The whole model on every golden request, each point against the accumulated budget;
    the model's own outputs (logits judged for agreement, or an encoder's hidden states), the
    greedy continuation, and the first divergence located (local or accumulated)."""
    stage = stage_of(model)
    ranks = None
    if stage is not None:  # every rank's stage, in the order one process judges them
        stage.start()
        order = {r.name: i for i, r in enumerate(golden.requests)}
        ranks = StageRanks(stage, lambda r: (order.get(r.request, -1),))
    return judged_model(
        golden, dtype, hidden_and_depth(model), policy,
        partial(observe_model, golden, model, dtype, device),
        _AloneOnTransformers(golden, model, dtype, device), config=model.config, ranks=ranks,
    ).verdict  # fmt: skip


@dataclass
class _AloneOnTransformers:
    """The transformers model's points run alone, for the judge to locate a divergence
    (``compare.model_judge.AloneObserver``)."""

    golden: GoldenSet
    model: Any
    dtype: str
    device: torch.device

    def observe_alone(self, point: str, see: Callable[[Observation], None]) -> None:
        if point not in {p.name for p in self.golden.points}:
            raise AloneUnsupported(f"the set has no point {point}")
        observe_layer(self.golden, self.model, self.golden.point(point), self.dtype,
                      self.device, see)  # fmt: skip

    def inputs_at_fault(
        self, failing: PointResult, compare: Callable[[str, Any, Any], CompareResult]
    ) -> tuple[tuple[str, str], ...] | None:
        def judged(path: str, actual: Any, expected: Any) -> CompareResult:
            # a tensor-parallel rank's shard gathered whole
            return compare(path, whole(actual, tuple(expected.shape)), expected)

        faulty = input_at_fault(self.golden, self.model, failing.point, failing.request,
                                failing.call, judged, self.device,
                                dtypes.torch_dtype(self.dtype))  # fmt: skip
        if faulty is None:
            return None
        return tuple((f.name, f.differs) for f in faulty if not f.name.startswith("args["))

    def feed(self, failing: PointResult) -> None:
        """The model's forward :meth:`inputs_at_fault` takes the point's inputs from, run
        for its own sake (a pipeline rank's share of it, ``replay.pipeline.StageAlone``)."""
        if failing.call < len(self.golden.point(failing.point).calls.get(failing.request, [])):
            fed_inputs(self.model, self.golden, failing.request, failing.point, failing.call,
                       self.device, dtypes.torch_dtype(self.dtype))  # fmt: skip


def greedy_steps(model: Any, inputs: dict[str, Any], tokens: Any) -> Iterator[Any]:
    """The model's last-position logits at each step of a greedy continuation of ``inputs``,
    the golden ``tokens`` [rows, steps] fed one per step (teacher-forced)."""
    import torch

    state = dict(inputs)
    for step in range(tokens.shape[1]):
        with torch.no_grad():
            _, logits = greedy_step(model, state)
        yield logits
        state = append_token(state, tokens[:, step : step + 1].to(state["input_ids"].device))
