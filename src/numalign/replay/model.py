"""Model replay over a golden set: layer replay (each point alone, fed the golden inputs,
against the isolated calibration) and full-model replay (every point as the whole model runs,
against the accumulated calibration), the model's own outputs (logits, or an encoder's hidden
states), the greedy continuation, and the first divergence, located. Results are the objects
of ``numalign.compare.model_verdict``, judged there against controls from
``compare.calibration``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from numalign import dtypes
from numalign.compare import CompareResult
from numalign.compare.calibration import control_for
from numalign.compare.exact import LeftOut, judge_left_out
from numalign.compare.logits import near_tie
from numalign.compare.model_verdict import (
    ContinuationResult,
    Divergence,
    ModelVerdict,
    PointResult,
    ReplayUnsupported,
    compare_point,
    first_divergence,
    judge_logits,
    label,
    logit_transform,
)
from numalign.compare.tolerances import thresholds_of
from numalign.golden.manifest import LOGIT_TRANSFORM, OUTPUT_POINT, Continuation, GoldenSetError
from numalign.golden.reference import append_token, forward_kwargs, load_model, model_outputs
from numalign.golden.store import DEFAULT_SETS, discover_sets
from numalign.replay.inputs import input_at_fault
from numalign.replay.layer import (
    AloneUnsupported,
    kept_positions,
    left_out,
    replay_call,
    request_mask,
)
from numalign.replay.leans import POOLED, PointLeans
from numalign.replay.observe import observe
from numalign.replay.shards import whole
from numalign.runtime.compiled import compile_model, take_stats
from numalign.runtime.variant import Variant

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet, Point
    from numalign.replay.tensor_parallel import RankGroup, ShardedModel
    from numalign.settings import Settings

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
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 1
    depth = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 1
    return int(hidden), int(depth)


@dataclass
class ModelCache:
    """Models loaded once per worker per set and :class:`~numalign.runtime.variant.Variant`
    (device, dtype, attention and experts implementations, swaps, compile variant, tensor
    parallel; the decode's cache is not part of it: one model serves every cache); a compiled
    model is a ``CompiledModel`` (``numalign.runtime.compiled``). Under ``--tp N`` a model
    is a ``ShardedModel``, held by this worker's tensor-parallel ranks, each of which keeps
    its own cache with ``sharded`` set (it loads its shard with transformers' ``tp_plan``);
    replays reach either kind through ``run``."""

    models: dict[tuple[str, Variant], Any] = field(default_factory=dict)
    #: This cache is a tensor-parallel rank's: models load sharded (``tp_plan="auto"``).
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
        from numalign.replay.swap import SwapUnmatched, apply_swaps, parse_swaps

        assert variant.dtype is not None, "a model loads in a dtype"
        if variant.stream:  # weights on the device one unit at a time (golden.stream)
            from numalign.golden.stream import load_streamed

            try:
                return load_streamed(
                    golden.model_dir, variant.dtype, variant.device,
                    attn_implementation=variant.attention, experts_implementation=variant.experts,
                )  # fmt: skip
            except ValueError as exc:  # as below: an implementation the model lacks
                if "implementation" not in str(exc):
                    raise
                raise ReplayUnsupported(str(exc).split(". ")[0]) from None
        try:
            model = load_model(
                golden.model_dir, variant.dtype, attn_implementation=variant.attention,
                trust_remote_code=False, experts_implementation=variant.experts,
                tp_plan="auto" if self.sharded else None,
            )  # fmt: skip
            if not self.sharded:  # transformers places a rank's shard itself
                model = model.to(variant.device)
            apply_swaps(model, parse_swaps(variant.swaps))
            if variant.compile is not None:  # after the swaps: the compiler sees the kernels
                model = compile_model(model, variant.compile, [p.name for p in golden.points])
        except SwapUnmatched as exc:  # another model of the session has the module
            raise ReplayUnsupported(str(exc)) from None
        except ValueError as exc:
            if "implementation" not in str(exc):
                raise
            raise ReplayUnsupported(str(exc).split(". ")[0]) from None
        return model

    @staticmethod
    def record_context(
        golden: GoldenSet, variant: Variant, device: torch.device, model: Any = None
    ) -> dict[str, Any]:
        """The fields every record of a model-suite test shares (the variant's among them);
        for a compiled ``model``, what compiling cost this test (compile time and graph
        breaks, apart from run time)."""
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
        session's settings ask (``model_for``; under ``--tp``, held by the ranks)."""
        golden = open_fresh(path)
        check_dtype(golden, dtype)
        if settings.tp > 1 and not self.sharded:
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
        ranks (started on first use; NoTensorParallelPlan or TensorParallelUsageError when the
        model cannot be split that way)."""
        from numalign.replay.tensor_parallel import RankGroup, ShardedModel, check_shardable

        check_shardable(golden.model_dir, settings.tp)
        group = self.groups.get(settings)
        if group is None:
            group = self.groups[settings] = RankGroup(settings.tp, settings, settings.tp_timeout)
        return ShardedModel(group, str(golden.path), dtype)

    @staticmethod
    def run(fn: Callable[..., T], golden: GoldenSet, model: Any, *args: Any) -> T:
        """``fn(golden, model, *args)``: here, or for a ``ShardedModel`` on every rank of its
        group (each with its shard and its own device in place of a ``torch.device``
        argument), rank 0's result. ``fn`` and ``args`` travel by pickle, between this
        process and its own ranks."""
        from numalign.replay.tensor_parallel import ShardedModel

        if isinstance(model, ShardedModel):
            result: T = model.group.call(replay_on_rank, fn, model.path, model.dtype, args)
            return result
        return fn(golden, model, *args)

    def close(self) -> None:
        """Stops this cache's tensor-parallel groups."""
        for group in self.groups.values():
            group.close()
        self.groups.clear()


def replay_on_rank(fn: Callable[..., T], path: str, dtype: str, args: tuple[Any, ...]) -> T:
    """``fn(golden, model, *args)`` on a tensor-parallel rank (``ModelCache.run`` sends it):
    the set at ``path`` (opened once per rank while its manifest stays the same) and its
    model loaded sharded (once per rank, by the rank's cache); a ``torch.device`` among
    ``args`` is replaced by the rank's device."""
    import torch

    from numalign.replay.tensor_parallel import RANK, rank_device

    device = rank_device()
    golden = RANK.golden(path)  # the controller checked it fresh for this call
    model = RANK.cache.model_for(golden, RANK.settings, device, dtype)
    args = tuple(device if isinstance(a, torch.device) else a for a in args)
    return fn(golden, model, *args)


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

    hidden, depth = hidden_and_depth(model)
    module = model.get_submodule(point.name)
    results = []
    leans = PointLeans(golden, dtype, hidden, thresholds_of(policy))
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
                expected = kept_positions(golden.tensor(key), mask)
                control = control_for(
                    golden,
                    dtype,
                    point.name,
                    path,
                    "isolated",
                    hidden,
                    depth,
                    thresholds_of(policy),
                )
                faults = left_out(actual.detach(), golden.tensor(key), mask)
                actual = kept_positions(actual.detach(), mask)
                gathered = whole(actual, tuple(expected.shape))  # a tensor-parallel shard
                result = judge_left_out(compare_point(gathered, expected, label(point.name, path),
                                                      control, policy), faults)  # fmt: skip
                results.append(PointResult(point.name, point.order, request, path, result,
                                           mode="isolated", call=index))  # fmt: skip
                leans.add(point.name, path, actual, expected, point.order, len(results))
    return results + leans.results()


def replay_model(
    golden: GoldenSet, model: Any, dtype: str, device: torch.device, policy: Any = None
) -> ModelVerdict:
    """The whole model on every golden request, each point against the accumulated budget;
    the model's own outputs (logits judged for agreement, or an encoder's hidden states), the
    greedy continuation, and the first divergence located (local or accumulated)."""
    import torch

    torch_dtype = dtypes.torch_dtype(dtype)
    hidden, depth = hidden_and_depth(model)
    points = {p.name: p for p in golden.points}
    verdict = ModelVerdict(points=[])
    leans = PointLeans(golden, dtype, hidden, thresholds_of(policy), mode="accumulated")
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
            control = control_for(
                golden, dtype, point, path, "accumulated", hidden, depth, thresholds_of(policy)
            )
            actual = whole(actual, tuple(expected.shape))  # a tensor-parallel rank's shard
            result = compare_point(actual, expected, label(point, path), control, policy)
            result = judge_left_out(result, pending.pop((name, point, path, call), None))
            verdict.points.append(
                PointResult(point, points[point].order, name, path, result,
                            finished=len(verdict.points), call=call)
            )  # fmt: skip
            # the lean ranks where the point's first result does, in the first divergence
            leans.add(point, path, actual, expected, points[point].order,
                      verdict.points[-1].finished)  # fmt: skip

        def on_left_out(
            point: str, path: str, faults: LeftOut, call: int, name: str = name
        ) -> None:
            pending[(name, point, path, call)] = faults

        with torch.no_grad(), observe(model, golden, name, on_output, on_left_out):
            out = model(**inputs, **forward_kwargs(model))
        mask = request_mask(golden, name)
        finals = model_outputs(out)
        logits_budget = 0.0
        for output, key in golden.final_outputs(name).items():
            actual = kept_positions(finals[output].detach().float().cpu(), mask)
            expected = kept_positions(golden.tensor(key), mask)
            control = control_for(
                golden, dtype, OUTPUT_POINT, output, "output", hidden, depth, thresholds_of(policy)
            )
            if output == "logits":
                logits = whole(actual.to(torch_dtype), tuple(expected.shape))
                judged = judge_logits(name, logits, expected, control, policy)
                verdict.logits.append(judged)
                logits_budget = judged.values.budget.get("max_abs", 0.0) if judged.values else 0.0
                continue
            final = whole(actual.to(torch_dtype), tuple(expected.shape))
            result = compare_point(final, expected, output, control, policy)
            verdict.outputs.append(PointResult(output, len(points), name, "0", result, "output"))
        continuation = golden.continuation(name)
        if continuation is not None and logits_budget > 0:
            later = later_positions_budget(golden, dtype, hidden, depth, policy)
            agreement = continuation_agreement(
                model,
                name,
                inputs,
                golden,
                continuation,
                logits_budget,
                later,
                thresholds_of(policy),
            )
            verdict.continuation.append(agreement)
    verdict.points += leans.results()  # each point's lean, every request pooled
    verdict.divergence = locate(golden, model, verdict.points, dtype, device, policy)
    failing_logits = [lg for lg in verdict.logits if not lg.passed and lg.values is not None]
    if verdict.divergence is None and failing_logits:
        # every point within budget and the logits not: the model's logit transform where it
        # is a point and fails alone; else a point that fails alone (its error, within its
        # budget in the whole model, carried on to the logits); else after the last capture
        # point (the logit transform the config names)
        first = failing_logits[0]
        assert first.values is not None
        if _fails_alone(golden, model, LOGIT_TRANSFORM, dtype, device, policy):
            verdict.divergence = Divergence(LOGIT_TRANSFORM, "local", first.request, first.values)
            return verdict
        named = _failing_upstream(golden, model, verdict.points, len(verdict.points), dtype,
                                  device, policy)  # fmt: skip
        if named:
            verdict.divergence = Divergence(
                OUTPUT_POINT, "accumulated", first.request, first.values, named=named
            )
        else:
            verdict.divergence = Divergence(
                OUTPUT_POINT, "output", first.request, first.values,
                why_unlocated=logit_transform(model.config),
            )  # fmt: skip
    return verdict


def locate(
    golden: GoldenSet,
    model: Any,
    results: list[PointResult],
    dtype: str,
    device: torch.device,
    policy: Any = None,
) -> Divergence | None:
    """The first divergence of a whole-model replay, located: ``local`` when its point,
    replayed alone on the golden inputs, leaves the isolated budget too, ``accumulated`` when
    the error comes from upstream."""
    failing = first_divergence(results)
    if failing is None:
        return None
    try:
        alone = replay_layer(golden, model, golden.point(failing.point), dtype, device, policy)
    except AloneUnsupported as exc:  # the whole model's verdict stands; only not located
        return Divergence(failing.point, "unlocated", failing.request, failing.result, str(exc))
    if any(not r.result.passed for r in alone):
        return Divergence(failing.point, "local", failing.request, failing.result)
    if failing.request == POOLED:  # a lean pooled over requests: no one call to refeed
        named = _failing_upstream(golden, model, results, failing.finished, dtype, device, policy)
        return Divergence(failing.point, "accumulated", failing.request, failing.result,
                          named=named)  # fmt: skip
    hidden, depth = hidden_and_depth(model)

    def judge(path: str, actual: Any, expected: Any) -> CompareResult:
        control = control_for(
            golden, dtype, failing.point, path, "isolated", hidden, depth, thresholds_of(policy)
        )
        actual = whole(actual, tuple(expected.shape))  # a tensor-parallel rank's shard
        return compare_point(actual, expected, label(failing.point, path), control, policy)

    faulty = input_at_fault(golden, model, failing.point, failing.request, failing.call,
                            judge, device, dtypes.torch_dtype(dtype))  # fmt: skip
    keywords = [f for f in faulty or () if not f.name.startswith("args[")]
    if keywords:
        return Divergence(failing.point, "input", failing.request, failing.result,
                          inputs=tuple((f.name, f.differs) for f in keywords))  # fmt: skip
    named = _failing_upstream(golden, model, results, failing.finished, dtype, device, policy)
    return Divergence(failing.point, "accumulated", failing.request, failing.result,
                      named=named)  # fmt: skip


#: How many points before an accumulated divergence are replayed alone to find the one that
#: errs itself: a block's worth (norms, attention, MLP) and the block before it.
UPSTREAM_POINTS = 8


def _failing_upstream(
    golden: GoldenSet,
    model: Any,
    results: list[PointResult],
    finished: int,
    dtype: str,
    device: torch.device,
    policy: Any,
) -> str | None:
    """The latest of the ``UPSTREAM_POINTS`` points that finished before the ``finished``-th
    result (in the order the forward called them) that fails alone on the golden inputs, its
    pooled lean included: the module whose error, within its own budget in the whole model,
    the failing point (or the logits) carries on."""
    first: dict[str, int] = {}
    for r in results:
        if r.finished < finished:
            first[r.point] = min(first.get(r.point, r.finished), r.finished)
    before = sorted(first.items(), key=lambda item: item[1])
    for point, _ in reversed(before[-UPSTREAM_POINTS:]):
        if point != OUTPUT_POINT and _fails_alone(golden, model, point, dtype, device, policy):
            return point
    return None


def _fails_alone(
    golden: GoldenSet, model: Any, point: str, dtype: str, device: torch.device, policy: Any
) -> bool:
    """Whether the set's ``point`` fails replayed alone on the golden inputs, its pooled lean
    included (False where the set has no such point, or it cannot run alone)."""
    if point not in {p.name for p in golden.points}:
        return False
    try:
        alone = replay_layer(golden, model, golden.point(point), dtype, device, policy)
    except AloneUnsupported:  # needs the model's shared state: not judged alone
        return False
    return any(not r.result.passed for r in alone)


def later_positions_budget(
    golden: GoldenSet, dtype: str, hidden: int, depth: int, policy: Any
) -> Callable[[Any, Any], float]:
    """The max-abs budget of logits at a position after the prompt, from the set's decode
    calibration (0 where it has none): ``budget(actual, expected)``."""
    control = control_for(golden, dtype, OUTPUT_POINT, "logits", "decode", hidden, depth,
                          thresholds_of(policy))  # fmt: skip
    torch_dtype = dtypes.torch_dtype(dtype)

    def budget(actual: Any, expected: Any) -> float:
        if not control.calibrated:
            return 0.0
        result = compare_point(actual.to(torch_dtype), expected, "logits", control, policy)
        return float(result.budget.get("max_abs", 0.0))

    return budget


def continuation_agreement(
    model: Any,
    request: str,
    inputs: dict[str, Any],
    golden: GoldenSet,
    continuation: Continuation,
    logits_budget: float,
    later_budget: Callable[[Any, Any], float] | None = None,
    thresholds: Any = None,
) -> ContinuationResult:
    """Greedy tokens of the replay against the golden continuation, teacher-forced: identical
    up to the first divergence, and there the two tokens' golden logits at most a near tie
    apart (``logits.near_tie``: twice the logits' max-abs budget, each may move by it). The
    budget is the larger of the prompt's (``logits_budget``) and, at the differing step,
    ``later_budget(its logits, the golden ones)``: the calibrated budget of positions after
    the prompt (the set's decode calibration), since a step's logits are a position the
    prompt's calibration never saw (bfloat16 errs there up to 17 times more: flex_olmo's
    tiny checkpoint, 0.18 in the prompt and 3.1 in decode)."""
    import torch

    tokens = golden.tensor(continuation.tokens)
    golden_logits = golden.tensor(continuation.logits).double()
    steps = tokens.shape[1]
    state = dict(inputs)
    first, gap = None, 0.0
    with torch.no_grad():
        for step in range(steps):
            logits = model(**state, **forward_kwargs(model)).logits[:, -1].double().cpu()
            mine = logits.argmax(-1)
            if first is None and not torch.equal(mine, tokens[:, step]):
                first = step
                theirs = golden_logits[:, step]
                gaps = theirs.gather(-1, tokens[:, step, None]) - theirs.gather(-1, mine[:, None])
                gap = float(gaps.max())
                if later_budget is not None:
                    later = later_budget(logits, theirs.float())
                    logits_budget = max(logits_budget, later)
            # teacher-force the golden token, so later steps compare like with like
            state = append_token(state, tokens[:, step : step + 1].to(state["input_ids"].device))
    return ContinuationResult(request, steps, first, gap, near_tie(logits_budget, thresholds))


def suite_sets(root: Path, extra: Sequence[Path], *, only: bool = False) -> list[Path]:
    """The golden sets the model suites replay: ``root``/golden/sets and each --golden (with
    ``only``, --golden-only: the --golden sets alone). Two different sets of one name are an
    error naming both: their tests would share ids, and one would be replayed for the other."""
    unique: dict[Path, Path] = {}
    for path in discover_sets([*([] if only else [root / DEFAULT_SETS]), *extra]):
        unique.setdefault(path.resolve(), path)
    by_name: dict[str, list[Path]] = {}
    for path in unique.values():
        by_name.setdefault(path.name, []).append(path)
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    if clashes:
        listed = "; ".join(f"{n}: {', '.join(map(str, ps))}" for n, ps in sorted(clashes.items()))
        raise GoldenSetError(
            f"golden sets share a name ({listed}); test ids name a set by its folder's name: "
            "rename one folder, or replay one set alone with --golden SET --golden-only"
        )
    return list(unique.values())


def unusable_sets(paths: Sequence[str | Path]) -> dict[str, str]:
    """Of the golden sets at ``paths``, those replay cannot use (a stale set: its model
    changed since the capture; a missing model folder; a broken manifest), each with the
    message that says why and how to fix it. The model suites fail one test of such a set with
    that message and skip its others, instead of failing every test with it."""
    out: dict[str, str] = {}
    for path in dict.fromkeys(str(p) for p in paths):
        try:
            open_fresh(path)
        except GoldenSetError as exc:
            out[path] = str(exc)
    return out


def open_fresh(path: str | Path) -> GoldenSet:
    """The set (opened once per process while its manifest stays the same), checked that its
    model did not change (StaleGoldenSetError otherwise; the model's fingerprint is hashed
    again only when a file of it changed)."""
    from numalign.golden.store import GoldenSet

    golden = GoldenSet.open_shared(path)
    golden.check_fresh()
    return golden
