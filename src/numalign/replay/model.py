"""Model replay over a golden set: layer replay (each point alone, fed the golden inputs,
against the isolated calibration) and full-model replay (every point as the whole model runs,
against the accumulated calibration), the model's own outputs (logits, or an encoder's hidden
states), the greedy continuation, and the first divergence, located. Results are the objects
of ``numalign.replay.verdict``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from numalign.compare import CompareResult, ControlErrors, compare
from numalign.compare.logits import logits_stats
from numalign.golden.manifest import OUTPUT_POINT, Continuation, GoldenSetError
from numalign.golden.reference import append_token, forward_kwargs, load_model, model_outputs
from numalign.golden.store import DEFAULT_SETS, discover_sets
from numalign.replay.inputs import MASK_PATH, input_at_fault, judged_masks
from numalign.replay.layer import AloneUnsupported, kept_positions, replay_call, request_mask
from numalign.replay.leans import PointLeans
from numalign.replay.observe import observe
from numalign.replay.shards import whole
from numalign.replay.verdict import (
    ContinuationResult,
    Divergence,
    LogitsResult,
    ModelVerdict,
    PointResult,
    first_divergence,
    label,
)
from numalign.runtime.compiled import CompiledModel, compile_model, take_stats
from numalign.runtime.variant import Variant

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet, Point
    from numalign.replay.tensor_parallel import RankGroup, ShardedModel
    from numalign.settings import Settings

T = TypeVar("T")


@dataclass(frozen=True)
class Control:
    """A point's control in one dtype, from the set's calibration: its errors (budget and
    distribution), the reduction length behind the point, and for logits the control's KL."""

    errors: ControlErrors
    reduction: int
    kl_max: float | None = None
    calibrated: bool = True
    #: the point runs inside the whole model (accumulated, decode, the model's outputs):
    #: honest differences upstream reach it
    propagated: bool = False


def control_for(
    golden: GoldenSet, dtype: str, point: str, path: str, mode: str, hidden: int, depth: int
) -> Control:
    """The control of a point's output in ``dtype`` (the set's calibration), and the
    reduction length behind it (the hidden size; times the depth for accumulated points).

    A dtype finer than the calibrated 16-bit ones (float32, float64) is also judged by the
    closest of those (float16, else bfloat16), scaled, and the control is the worse of that
    and its own ensemble calibration (where the set has one). The reference model amplifies
    an error the same way in every dtype (linear error propagation), so what matters is the
    error each operation makes. A float16 kernel (float32 accumulation, one rounding) errs by
    about one float16 rounding; a float32 kernel that sums a reduction of length K in another
    order (a fused norm, other threads, another device) errs by up to sqrt(K) float32
    roundings. The borrowed errors therefore scale by s = 2**-13 * sqrt(hidden) (the ratio of
    unit roundoffs times the reduction's walk); errors and the norm ratio's deviation from 1
    by s, 1 - cosine and KL, quadratic in the error, by s**2. The ensemble samples the
    kernels it can select (instruction sets, threads, attention); the scaled bound covers an
    implementation that reorders every reduction, which no member does (an honest fused
    RMSNorm swapped into tiny-qwen3-next in float32 erred 8.7x the ensemble's worst)."""
    propagated = mode in ("accumulated", "output", "decode")
    reduction = hidden * (depth if propagated else 1)
    own = _calibration(golden, dtype, point, path, mode)
    candidates = [_scaled(own, 1.0)] if own is not None else []
    borrowed = _borrowed(golden, dtype, point, path, mode, hidden)
    if borrowed is not None:
        candidates.append(borrowed)
    if not candidates:
        return Control(ControlErrors(max_abs=0.0, rel_l2=0.0), reduction, calibrated=False)
    errors = [c for c, _ in candidates]
    kls = [kl for _, kl in candidates if kl is not None]
    norms = [e.norm_ratio for e in errors if e.norm_ratio is not None]
    zeros = [e.zero_fraction for e in errors if e.zero_fraction is not None]
    return Control(
        ControlErrors(
            max_abs=max(e.max_abs for e in errors),
            rel_l2=max(e.rel_l2 for e in errors),
            cosine=min(e.cosine for e in errors),
            norm_ratio=max(norms, key=lambda v: abs(v - 1.0)) if norms else None,
            zero_fraction=max(zeros) if zeros else None,
        ),
        reduction,
        kl_max=max(kls) if kls else None,
        propagated=propagated,
    )


def _borrowed(
    golden: GoldenSet, dtype: str, point: str, path: str, mode: str, hidden: int
) -> tuple[ControlErrors, float | None] | None:
    """The closest 16-bit calibration scaled to ``dtype`` (see ``control_for``), for dtypes
    finer than it; None for the 16-bit dtypes themselves or where neither is calibrated."""
    from numalign.compare.tolerances import FLOAT_FORMATS

    if dtype not in FLOAT_FORMATS or dtype in ("float16", "bfloat16"):
        return None
    for source in ("float16", "bfloat16"):
        stats = _calibration(golden, source, point, path, mode)
        if stats is not None:
            roundoff = 2.0 ** (FLOAT_FORMATS[source][0] - FLOAT_FORMATS[dtype][0])
            return _scaled(stats, roundoff * math.sqrt(hidden) if roundoff < 1 else roundoff)
    return None


def _scaled(stats: Any, scale: float) -> tuple[ControlErrors, float | None]:
    """A calibration's statistics as the control's errors (scaled by ``scale``) and KL."""
    norm_ratio = stats.get("norm_ratio")
    kl = stats.get("kl_max")
    errors = ControlErrors(
        max_abs=float(stats["max_abs"]) * scale,
        rel_l2=float(stats["rel_l2"] or 0.0) * scale,
        cosine=1.0 - (1.0 - float(stats.get("cosine") or 1.0)) * scale**2,
        norm_ratio=None if norm_ratio is None else 1.0 + (float(norm_ratio) - 1.0) * scale,
        zero_fraction=stats.get("zero_fraction"),
    )
    return errors, None if kl is None else float(kl) * scale**2


def _calibration(golden: GoldenSet, dtype: str, point: str, path: str, mode: str) -> Any:
    # the model's own outputs are calibrated as the whole model runs
    return golden.calibrated(dtype, point, path, "accumulated" if mode == "output" else mode)


def hidden_and_depth(model: Any) -> tuple[int, int]:
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 1
    depth = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 1
    return int(hidden), int(depth)


def compare_point(
    actual: torch.Tensor, expected: torch.Tensor, name: str, control: Control, policy: Any
) -> CompareResult:
    actual = whole(actual, tuple(expected.shape))  # a tensor-parallel rank's shard
    if not expected.is_floating_point():
        return compare(actual, expected, name=name)
    if not control.calibrated:  # a budget without a control would be one ulp
        dtype = str(actual.dtype).removeprefix("torch.")
        raise Uncalibrated(
            f"{name}: the golden set has no calibration of it in {dtype} (captured with "
            f"--calibrate '' or without {dtype}): not judged, since a budget without a control "
            "would be one ulp and the tolerance table is not made for whole modules; capture "
            f"it again with --calibrate {dtype}"
        )
    reach = chance_zero_reach(control.errors, expected, str(actual.dtype).removeprefix("torch."))
    return compare(actual, expected, control_errors=control.errors,
                   reduction_length=control.reduction, op_class="matmul", name=name,
                   policy=policy, zero_reach=reach, propagated=control.propagated)  # fmt: skip


def chance_zero_reach(errors: ControlErrors, expected: torch.Tensor, dtype: str) -> float | None:
    """How far from zero the reference may lie where an honest candidate lands exactly on
    zero: the control's worst error plus one rounding (ulp in ``dtype``) of the output's
    largest magnitude (None where the dtype or the output gives no scale).

    A model's outputs are sums rounded to the dtype (a residual add, a row-parallel
    all-reduce of partial sums, a fused kernel's accumulation). An honest candidate's value
    before that last rounding is the reference plus its honest error (at most the ensemble's
    worst, ``errors.max_abs``); where that sum is smaller than one rounding of the addends, the
    rounded sum lands exactly on zero (``a + b == 0`` in bfloat16). The reference in float32
    almost never does, each honest implementation at other places. Those zeros are chance;
    the output's largest magnitude stands for the addends' scale. Zeros where the reference
    lies beyond the reach (a zeroed tile or row) still fail, counted position by position."""
    from numalign.compare.tolerances import FLOAT_FORMATS

    if dtype not in FLOAT_FORMATS or not expected.numel():
        return None
    largest = float(expected.abs().max())
    if largest == 0 or not math.isfinite(largest):
        return None
    ulp = 2.0 ** (math.floor(math.log2(largest)) - FLOAT_FORMATS[dtype][0])
    return ulp + (errors.max_abs if math.isfinite(errors.max_abs) else 0.0)


class ReplayUnsupported(RuntimeError):
    """transformers cannot load this model with the asked-for implementation (Gemma 2 has
    no SDPA path, say): the replay is skipped with transformers' reason."""


class Uncalibrated(ReplayUnsupported):
    """The set has no calibration of a point in the replay's dtype (``--calibrate ''``): the
    replay is skipped with that reason, never judged against a budget of one ulp."""


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
        if key not in self.models:
            self.models[key] = self._load(golden, key[1])
        return self.models[key]

    def _load(self, golden: GoldenSet, variant: Variant) -> Any:
        from numalign.replay.swap import SwapUnmatched, apply_swaps, parse_swaps

        assert variant.dtype is not None, "a model loads in a dtype"
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
    import torch

    hidden, depth = hidden_and_depth(model)
    module = model.get_submodule(point.name)
    results = []
    leans = PointLeans(golden, dtype, hidden)
    for request, calls in point.calls.items():
        mask = request_mask(golden, request)
        for index, call in enumerate(calls):
            outputs = replay_call(module, golden, call, device=device, dtype=getattr(torch, dtype))
            for path, key in call.outputs.items():
                actual = outputs.get(path)
                if actual is None:  # e.g. attention weights, which only eager returns
                    continue
                expected = kept_positions(golden.tensor(key), mask)
                control = control_for(golden, dtype, point.name, path, "isolated", hidden, depth)
                actual = kept_positions(actual.detach(), mask)
                result = compare_point(actual, expected, label(point.name, path), control, policy)
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

    torch_dtype = getattr(torch, dtype)
    hidden, depth = hidden_and_depth(model)
    points = {p.name: p for p in golden.points}
    verdict = ModelVerdict(points=[])
    for request in golden.requests:
        name = request.name
        inputs = {
            k: golden.tensor(v, device=device, dtype=torch_dtype) for k, v in request.inputs.items()
        }

        def on_output(
            point: str, path: str, actual: Any, expected: Any, call: int, name: str = name
        ) -> None:
            control = control_for(golden, dtype, point, path, "accumulated", hidden, depth)
            result = compare_point(actual, expected, label(point, path), control, policy)
            verdict.points.append(
                PointResult(point, points[point].order, name, path, result,
                            finished=len(verdict.points), call=call)
            )  # fmt: skip

        def on_mask(point: str, path: str, actual: Any, expected: Any, call: int,
                    name: str = name) -> None:  # fmt: skip
            # exact, as booleans; recorded in the replay's dtype like every point
            result = replace(compare(actual, expected, name=label(point, path)), dtype=dtype)
            verdict.points.append(PointResult(point, points[point].order, name, path, result,
                                              finished=len(verdict.points), call=call))  # fmt: skip

        masks = judged_masks if not isinstance(model, CompiledModel) else _no_masks
        with (
            torch.no_grad(),
            observe(model, golden, name, on_output),
            masks(model, golden, name, on_mask),
        ):
            out = model(**inputs, **forward_kwargs(model))
        mask = request_mask(golden, name)
        finals = model_outputs(out)
        logits_budget = 0.0
        for output, key in golden.final_outputs(name).items():
            actual = kept_positions(finals[output].detach().float().cpu(), mask)
            expected = kept_positions(golden.tensor(key), mask)
            control = control_for(golden, dtype, OUTPUT_POINT, output, "output", hidden, depth)
            if output == "logits":
                judged = judge_logits(name, actual.to(torch_dtype), expected, control, policy)
                verdict.logits.append(judged)
                logits_budget = judged.values.budget.get("max_abs", 0.0) if judged.values else 0.0
                continue
            result = compare_point(actual.to(torch_dtype), expected, output, control, policy)
            verdict.outputs.append(PointResult(output, len(points), name, "0", result, "output"))
        continuation = golden.continuation(name)
        if continuation is not None and logits_budget > 0:
            verdict.continuation.append(
                continuation_agreement(model, name, inputs, golden, continuation, logits_budget)
            )
    verdict.divergence = locate(golden, model, verdict.points, dtype, device, policy)
    failing_logits = [lg for lg in verdict.logits if not lg.passed and lg.values is not None]
    if verdict.divergence is None and failing_logits:
        # every point within budget and the logits not: after the last capture point
        first = failing_logits[0]
        assert first.values is not None
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
    if failing.path.startswith(MASK_PATH.format("")):  # a mask the model built, judged exactly
        differs = (
            f"{failing.result.metrics.mismatch_count} of {failing.result.metrics.numel} "
            "mask entries attend differently"
        )
        mask = failing.path.removeprefix(MASK_PATH.format(""))
        return Divergence(failing.point, "input", failing.request, failing.result,
                          inputs=((mask, differs),))  # fmt: skip
    try:
        alone = replay_layer(golden, model, golden.point(failing.point), dtype, device, policy)
    except AloneUnsupported as exc:  # the whole model's verdict stands; only not located
        return Divergence(failing.point, "unlocated", failing.request, failing.result, str(exc))
    if any(not r.result.passed for r in alone):
        return Divergence(failing.point, "local", failing.request, failing.result)
    hidden, depth = hidden_and_depth(model)

    def judge(path: str, actual: Any, expected: Any) -> CompareResult:
        control = control_for(golden, dtype, failing.point, path, "isolated", hidden, depth)
        return compare_point(actual, expected, label(failing.point, path), control, policy)

    faulty = input_at_fault(golden, model, failing.point, failing.request, failing.call,
                            judge, device, _torch_dtype(dtype))  # fmt: skip
    keywords = [f for f in faulty or () if not f.name.startswith("args[")]
    if keywords:
        return Divergence(failing.point, "input", failing.request, failing.result,
                          inputs=tuple((f.name, f.differs) for f in keywords))  # fmt: skip
    named = _failing_upstream(golden, model, results, failing, dtype, device, policy)
    return Divergence(failing.point, "accumulated", failing.request, failing.result,
                      named=named)  # fmt: skip


#: How many points before an accumulated divergence are replayed alone to find the one that
#: errs itself: a block's worth (norms, attention, MLP) and the block before it.
UPSTREAM_POINTS = 8


def _failing_upstream(
    golden: GoldenSet,
    model: Any,
    results: list[PointResult],
    failing: PointResult,
    dtype: str,
    device: torch.device,
    policy: Any,
) -> str | None:
    """The latest of the ``UPSTREAM_POINTS`` points before ``failing`` (in the order the
    forward called them) that fails alone on the golden inputs, its pooled lean included:
    the module whose error, within its own budget in the whole model, the failing point
    carries on."""
    first: dict[str, int] = {}
    for r in results:
        if r.finished < failing.finished:
            first[r.point] = min(first.get(r.point, r.finished), r.finished)
    before = sorted(first.items(), key=lambda item: item[1])
    for point, _ in reversed(before[-UPSTREAM_POINTS:]):
        if point == OUTPUT_POINT:
            continue
        try:
            alone = replay_layer(golden, model, golden.point(point), dtype, device, policy)
        except AloneUnsupported:  # needs the model's shared state: not judged alone
            continue
        if any(not r.result.passed for r in alone):
            return point
    return None


#: Config attributes of a transform models apply to their logits after the LM head.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@contextmanager
def _no_masks(*args: Any) -> Iterator[None]:
    """A compiled model's masks are inside its graph: not judged."""
    yield


def _torch_dtype(dtype: str) -> torch.dtype:
    import torch

    return getattr(torch, dtype)  # type: ignore[no-any-return]


def logit_transform(config: Any) -> str:
    """What the model does to its logits after the LM head, from its config (soft-capping,
    scaling), for a divergence that only the logits show."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = [
        f"{name} {value}"
        for name in LOGIT_TRANSFORMS
        if (value := getattr(text, name, None)) not in (None, 1, 1.0)
    ]
    where = f" ({', '.join(found)})" if found else " (the config names none)"
    return (
        "every capture point is within budget and the logits are not: the fault is after the "
        f"LM head, in the model's final logit transform{where}"
    )


def judge_logits(
    request: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    control: Control,
    policy: Any = None,
) -> LogitsResult:
    """One request's logits ([kept positions, vocab]) against the golden ones: values within
    the calibrated budget, top-1 and top-5 differences only among near ties (golden logits
    within twice the max-abs budget: each of two logits may move by the budget), and KL at
    most the squared spread of the budget times the control's KL plus a rounding floor."""
    from numalign.compare.tolerances import DEFAULT_POLICY, FLOAT_FORMATS

    if not control.calibrated or control.kl_max is None:
        return LogitsResult(
            request, None, None,
            skipped="the golden set has no logits calibration in this dtype (captured with "
            "--calibrate '' or without it, or by an older numalign): capture it again with "
            "--calibrate DTYPE to judge the logits",
        )  # fmt: skip
    values = compare_point(actual, expected, "logits", control, policy)
    near_tie = 2.0 * float(values.budget.get("max_abs", 0.0))
    stats = logits_stats(actual.flatten(0, -2), expected.flatten(0, -2), near_tie)
    dtype = str(actual.dtype).removeprefix("torch.")
    spread = (policy or DEFAULT_POLICY).budget("logits", dtype, None).rel_l2_multiplier
    largest = float(expected.abs().max()) if expected.numel() else 0.0
    ulp = 2.0 ** (math.floor(math.log2(largest)) - FLOAT_FORMATS[dtype][0]) if largest > 0 else 0.0
    # KL of two roundings of every logit: at most (2 * ulp / 2)**2 / 2; and the KL's own
    # float64 evaluation, a sum over the vocabulary of p * (log p - log q) terms whose
    # roundings reach about eps64 times the entropy (at most log(vocab)) plus one
    vocab = int(expected.shape[-1]) if expected.dim() else 1
    evaluation = 2.0**-52 * (math.log(max(vocab, 1)) + 1.0)
    kl_budget = spread**2 * control.kl_max + ulp**2 / 2 + evaluation
    return LogitsResult(request, values, stats, kl_budget)


def continuation_agreement(
    model: Any,
    request: str,
    inputs: dict[str, Any],
    golden: GoldenSet,
    continuation: Continuation,
    logits_budget: float,
) -> ContinuationResult:
    """Greedy tokens of the replay against the golden continuation, teacher-forced: identical
    up to the first divergence, and there the two tokens' golden logits at most twice the
    logits' max-abs budget apart (a near tie the budget explains)."""
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
            # teacher-force the golden token, so later steps compare like with like
            state = append_token(state, tokens[:, step : step + 1].to(state["input_ids"].device))
    return ContinuationResult(request, steps, first, gap, 2.0 * logits_budget)


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
