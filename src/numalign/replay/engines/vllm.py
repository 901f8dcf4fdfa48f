"""The vLLM engine: a golden set replayed through vLLM's own model code, in this process.

Every row of every golden request is served as its real tokens (an engine never pads), all
together through vLLM's continuous batching with a small token budget per step, so long
prompts are prefilled in chunks beside other requests' decode steps. Rows of the set's
decode requests are teacher-forced with the golden tokens (a logits processor leaves the
sampler only the golden token), so each decode step runs in vLLM's paged KV cache and
compares like with like. Hooks on the mapped modules (``vllm_points``) read each row's
positions out of the flattened batch, and the engine's own logits computation gives the
full-vocabulary logits at every position (``vllm_serving``). One serving per (set, dtype)
feeds the model test (every point and the logits of the prompts) and the decode test (every
step's new token). What an engine is started with (its options for a serving arrangement, its
KV cache, the guards vLLM's CPU build needs) is ``vllm_options``'s.

Modules that run alone (norms, MLPs, MoE blocks) are also replayed alone on the golden
inputs (layer replay, and locating a divergence); attention, which needs vLLM's forward
context (its attention metadata and KV cache), is skipped with that reason
(``vllm_alone``).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.core import dtypes
from numalign.core.observation import Event, FinalOutput, Observation, label
from numalign.golden.manifest import OUTPUT_POINT
from numalign.golden.positions import expected_at, kept_positions
from numalign.golden.requests import unservable
from numalign.golden.routing import ROUTING
from numalign.replay.decode import require_decode_replayable
from numalign.replay.engines import NotJudged, Replayed
from numalign.replay.engines.errors import EngineError, EngineUnsupported
from numalign.replay.engines.vllm_alone import (
    AloneOnVllm,
    observe_isolated,
    observe_residuals,
)
from numalign.replay.engines.vllm_in_context import runs_attention
from numalign.replay.engines.vllm_kernels import moe_scale
from numalign.replay.engines.vllm_options import (
    ENGINE_ENV,
    allow_amx,
    configuration,
    onednn_capped_below,
    serving_options,
)
from numalign.replay.engines.vllm_points import (
    LM_HEAD,
    PointMap,
    map_points,
)
from numalign.replay.engines.vllm_serving import (
    Running,
    Served,
    decode_step_count,
    engine_rows,
    hidden_and_depth_of,
    prompt_rows,
    quiet,
    row_lengths,
    serve_rows,
    step_rows,
)
from numalign.replay.judging import judged_decode, judged_layer, judged_model
from numalign.replay.layer import AloneUnsupported, request_mask
from numalign.replay.sets import open_fresh
from numalign.runtime.serving import ARRANGEMENTS, DEFAULT_SERVING, Arrangement
from numalign.runtime.variant import Variant

if TYPE_CHECKING:
    import torch

    from numalign.core.kernel_scale import KnownScale
    from numalign.golden.store import GoldenSet
    from numalign.session.settings import Settings

#: vLLM's messages for a model or configuration it does not serve (the test skips with it).
UNSUPPORTED = ("Unsupported CPU attention", "not supported", "There is no module or parameter",
               "is not supported", "does not support", "do not support")  # fmt: skip


#: vLLM's message for a KV-cache share larger than the machine holds.
MEMORY = ("less than requested memory", "No available memory for the cache blocks",
          "Insufficient memory")  # fmt: skip


class VllmEngine:
    name = "vllm"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._running: Running | None = None
        self._served: dict[tuple[str, str, str], Served] = {}
        #: sets vLLM does not serve, with its reason (not started again for each test)
        self._unsupported: dict[str, str] = {}

    @staticmethod
    def caches(settings: Settings) -> tuple[str, ...]:
        """vLLM decodes in its own paged KV cache."""
        return ("paged",)

    # -- the three replays -------------------------------------------------------------

    def model(
        self,
        path: str | Path,
        dtype: str,
        device: torch.device,
        policy: Any,
        serving: str | None = None,
    ) -> Replayed:
        golden = open_fresh(path)
        arrangement = ARRANGEMENTS[serving or DEFAULT_SERVING]
        running = self._engine(golden, dtype, arrangement)
        served = self._serve(golden, dtype, arrangement)
        # the engine's model replay pools no leans: whether vLLM's honest kernels pass them is
        # not measured (docs/design.md); the judge locates the first divergence with vLLM's
        # modules run alone
        judged = judged_model(
            golden, dtype, hidden_and_depth_of(running), policy,
            partial(_observe_prompts, golden, running, served, dtype),
            AloneOnVllm(running, golden, dtype, arrangement), leans=False,
            config=getattr(running.model, "config", None), known=_known(running, dtype),
        )  # fmt: skip
        context = self._context(golden, running, arrangement)
        return Replayed(golden, judged.verdict, context, known=judged.known)

    def decode(
        self,
        path: str | Path,
        dtype: str,
        cache: str,
        device: torch.device,
        policy: Any,
        serving: str | None = None,
    ) -> Replayed:
        golden = open_fresh(path)
        require_decode_replayable(golden, dtype)
        arrangement = ARRANGEMENTS[serving or DEFAULT_SERVING]
        running = self._engine(golden, dtype, arrangement)
        served = self._serve(golden, dtype, arrangement)
        judged = judged_decode(golden, dtype, hidden_and_depth_of(running), policy, cache,
                               partial(_observe_steps, golden, running, served, dtype),
                               leans=False, known=_known(running, dtype))  # fmt: skip
        context = self._context(golden, running, arrangement, cache)
        return Replayed(golden, judged.verdict, context, known=judged.known)

    def layer(
        self, path: str | Path, point: str, dtype: str, device: torch.device, policy: Any
    ) -> Replayed:
        golden = open_fresh(path)
        running = self._engine(golden, dtype)
        pm = next(m for m in running.mapping if m.point == point)
        context = self._context(golden, running, ARRANGEMENTS[DEFAULT_SERVING])
        if self.settings.compile_backend is not None:
            raise NotJudged(COMPILED, context)
        if pm.module is None:
            raise NotJudged(f"unmapped: {pm.reason}", context)
        observe = partial(observe_isolated, running, golden, golden.point(point), pm.module, dtype)
        # a module that runs attention is replayed inside the served model, which pools no
        # leans, as the model replay pools none: vLLM's CPU attention kernel leans in bfloat16
        # where the CPU lacks AMX (measured, docs/vllm.md), a lean no known scale explains yet
        in_context = pm.module != LM_HEAD and runs_attention(running.model.get_submodule(pm.module))
        try:
            judged = judged_layer(golden, dtype, hidden_and_depth_of(running), policy, observe,
                                  known=_known(running, dtype), leans=not in_context)  # fmt: skip
        except AloneUnsupported as exc:
            raise NotJudged(str(exc), context) from exc
        return Replayed(golden, judged.verdict, context, known=judged.known)

    def close(self) -> None:
        self._stop()

    # -- the engine ------------------------------------------------------------------

    def _engine(
        self, golden: GoldenSet, dtype: str, arrangement: Arrangement | None = None
    ) -> Running:
        """The engine serving ``golden`` in ``dtype`` configured for ``arrangement`` (None:
        the running one for the set and dtype, else the default's), started if it is not the
        running one (one engine per worker at a time: each holds its share of the memory)."""
        running = self._running
        if arrangement is None:
            same = running is not None and running.key[:2] == (str(golden.path), dtype)
            arrangement = running.arrangement if same and running else ARRANGEMENTS[DEFAULT_SERVING]
        key = (str(golden.path), dtype, configuration(arrangement))
        reason = self._unsupported.get(str(golden.path))
        if reason is not None:
            raise EngineUnsupported(reason)
        if running is not None and running.key == key:
            return running
        self._stop()
        self._running = self._start(golden, dtype, arrangement)
        return self._running

    def _start(self, golden: GoldenSet, dtype: str, arrangement: Arrangement) -> Running:
        os.environ.update(ENGINE_ENV)
        capped = onednn_capped_below(dtype)
        if capped is not None:
            raise EngineUnsupported(f"vLLM does not serve {golden.name} in {dtype} here: {capped}")
        allow_amx()
        # the rows, their decode steps, and room for drafts past the last one
        length = max(row_lengths(golden), default=16) + 2 * decode_step_count(golden) + 2
        llm = None
        try:
            with quiet():
                from vllm import LLM, SamplingParams
                from vllm.inputs import TokensPrompt

                llm = LLM(
                    model=str(golden.model_dir), skip_tokenizer_init=True, dtype=dtype,
                    gpu_memory_utilization=self.settings.vllm_memory, max_model_len=length,
                    enforce_eager=self.settings.compile_backend is None, seed=0,
                    **serving_options(golden, dtype, arrangement, length),
                )  # fmt: skip
                # one short request first: what vLLM cannot serve (an attention configuration
                # its kernels lack) fails here, before any test judges anything
                warmup = TokensPrompt(prompt_token_ids=[0, 1, 2, 3])
                llm.generate([warmup], SamplingParams(max_tokens=1, detokenize=False),
                             use_tqdm=False)  # fmt: skip
        except Exception as exc:
            _shutdown(llm)
            del llm
            self._cleanup()
            raise self._failure(golden, exc, "start") from None
        with quiet():
            worker = llm.collective_rpc(_worker)[0]
        runner = worker.model_runner
        model = runner.get_model()
        modules = {n: type(m).__name__ for n, m in model.named_modules()}
        config = getattr(model, "config", None)
        routers = {
            p.name
            for p in golden.points
            if any(ROUTING in c.outputs for calls in p.calls.values() for c in calls)
        }
        mapping = map_points(type(model).__name__, [p.name for p in golden.points], modules,
                             config, routers)  # fmt: skip
        if self.settings.compile_backend is not None:
            mapping = [_compiled(pm) for pm in mapping]
        key = (str(golden.path), dtype, configuration(arrangement))
        return Running(key, llm, model, runner, mapping, _variant(llm, model), arrangement)

    def _stop(self) -> None:
        running, self._running = self._running, None
        self._served.clear()
        if running is None:
            return
        _shutdown(running.llm)
        del running
        self._cleanup()

    @staticmethod
    def _cleanup() -> None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        gc.collect()
        cleanup_dist_env_and_memory()

    def _failure(self, golden: GoldenSet, exc: BaseException, when: str) -> Exception:
        """What vLLM's exception becomes: unsupported (remembered, the set's tests skip),
        memory (an error naming the option to lower), anything else an engine error."""
        text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500]
        # a KeyError while the engine starts is a checkpoint tensor vLLM's model has no place
        # for (its own layout of the architecture): a checkpoint it does not serve
        # and vLLM's configuration refusing the model (a pydantic ValidationError of its
        # ModelConfig: a multimodal model served without its processor, say)
        layout = when == "start" and (
            isinstance(exc, KeyError) or type(exc).__name__ == "ValidationError"
        )
        if layout or any(m in str(exc) for m in UNSUPPORTED):
            reason = f"vLLM does not serve {golden.name} here: {text}"
            self._unsupported[str(golden.path)] = reason
            return EngineUnsupported(reason)
        if any(m in str(exc) for m in MEMORY):
            return EngineError(
                f"vLLM could not reserve memory for {golden.name} ({text}): free memory, run "
                "fewer xdist workers (each starts its own engine; -n 1 needs least), or on a "
                f"GPU lower --vllm-memory (now {self.settings.vllm_memory}); the KV cache itself "
                "is sized to the replay"
            )
        return EngineError(f"vLLM failed to {when} for {golden.name}: {text}")

    def _context(
        self,
        golden: GoldenSet,
        running: Running,
        arrangement: Arrangement,
        cache: str | None = None,
    ) -> dict[str, Any]:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type or "cpu")
        engine_variant = running.variant
        if arrangement.name != DEFAULT_SERVING:  # the default's records keep their variant
            engine_variant += f",vllm-serving={arrangement.name}"
        variant = Variant.from_settings(
            self.settings, device=device, dtype=running.key[1], cache=cache
        ).with_changes(engine_variant=engine_variant)
        return {"suite": "models", "candidate": "vllm", "device": device,
                "golden_fingerprint": golden.model.fingerprint, "model": golden.name,
                **variant.record_fields()}  # fmt: skip

    # -- serving -----------------------------------------------------------------------

    def _serve(self, golden: GoldenSet, dtype: str, arrangement: Arrangement) -> Served:
        """Every row of the set served in ``arrangement`` (cached for the running engine);
        EngineUnsupported where the serving did not exercise what the arrangement is for."""
        key = (str(golden.path), dtype, arrangement.name)
        if key not in self._served:
            running = self._engine(golden, dtype, arrangement)
            try:
                self._served[key] = serve_rows(running, golden, arrangement)
            except EngineUnsupported:  # served, and what it served cannot be judged
                raise
            except EngineError:
                self._stop()
                raise
            except Exception as exc:
                failure = self._failure(golden, exc, "serve")
                self._stop()
                raise failure from None
        served = self._served[key]
        missing = served.exercised.unexercised(arrangement, golden.name, row_lengths(golden))
        if missing is not None:
            raise EngineUnsupported(missing)
        return served


def _observe_prompts(
    golden: GoldenSet, running: Running, served: Served, dtype: str, see: Callable[[Event], None]
) -> dict[str, str]:
    """Every served prompt row's mapped points, fused residual streams and logits beside the
    golden ones, handed to ``see``; the points and requests vLLM has no counterpart for."""
    unmapped = _unmapped(running.mapping)
    torch_dtype = dtypes.torch_dtype(dtype)
    for request in golden.requests:
        rows = engine_rows(golden, request.name)
        if rows is None:
            unmapped[f"request {request.name}"] = str(unservable(request.inputs, golden.tensor))
            continue
        mask = request_mask(golden, request.name)
        for pm in running.mapping:
            if pm.module is None:
                continue
            calls = golden.point(pm.point).calls.get(request.name)
            if not calls:  # the point does not run for this request
                continue
            for path, key in calls[0].outputs.items():
                # the tensor at its kept positions, or the statistics a set keeps of it
                expected = expected_at(golden, key, mask)
                if path != "0":
                    if len(expected.shape) < 4:  # attention weights: eager's only
                        unmapped.setdefault(label(pm.point, path),
                                            "vLLM's module returns no such output")  # fmt: skip
                    continue
                actual = prompt_rows(served, rows, pm.module)
                if tuple(actual.shape) != tuple(expected.shape):
                    unmapped[label(pm.point, path)] = (
                        f"vLLM's {pm.module} gives {tuple(actual.shape)}, the reference "
                        f"{tuple(expected.shape)}"
                    )
                    continue
                see(Observation(
                    pm.point, path, request.name, actual.to(torch_dtype), expected,
                    finished=served.order.get(pm.module, 0),
                ))  # fmt: skip
        observe_residuals(see, served, golden, request.name, rows, running.mapping,
                          torch_dtype)  # fmt: skip
        finals = golden.final_outputs(request.name)
        if "logits" in finals:
            expected = kept_positions(golden.tensor(finals["logits"]), mask)
            actual = prompt_rows(served, rows, OUTPUT_POINT).to(torch_dtype)
            see(FinalOutput(request.name, "logits", actual, expected))
    return unmapped


def _observe_steps(
    golden: GoldenSet, running: Running, served: Served, dtype: str, see: Callable[[Event], None]
) -> dict[str, str]:
    """Every served decode row's steps (the mapped points' new tokens and the logits) beside
    the golden ones, handed to ``see``; the points and requests vLLM has no counterpart for."""
    unmapped = _unmapped(running.mapping)
    torch_dtype = dtypes.torch_dtype(dtype)
    modules = {pm.point: pm.module for pm in running.mapping if pm.module is not None}
    for request in golden.decode_requests:
        rows = engine_rows(golden, request)
        decode = golden.decode(request)
        if rows is None:
            inputs = golden.request(request).inputs
            unmapped[f"request {request}"] = str(unservable(inputs, golden.tensor))
        if rows is None or decode is None:
            continue
        for number, step in enumerate(decode.steps, start=1):
            for point, calls in step.points.items():
                if point not in modules:
                    continue
                for path, key in calls[0].items():
                    if path != "0":
                        continue
                    actual = step_rows(served, rows, modules[point], number)
                    see(Observation(
                        point, path, request, actual.to(torch_dtype), golden.tensor(key),
                        step=number, finished=served.order.get(modules[point], 0),
                    ))  # fmt: skip
            logits = step_rows(served, rows, OUTPUT_POINT, number)[:, 0]
            see(Observation(OUTPUT_POINT, "logits", request, logits.to(torch_dtype),
                                  golden.tensor(step.logits), step=number))  # fmt: skip
    return unmapped


#: Why no point inside the model is read under --compile.
COMPILED = (
    "vLLM's compiled graph (--compile) runs the model's body as captured graphs, which module "
    "hooks do not reach: the compiled replay judges the engine's logits (and the lm_head "
    "point); replay without --compile to judge every point"
)


def _compiled(pm: PointMap) -> PointMap:
    """A point as the compiled engine serves it: only the logits are read."""
    if pm.module == LM_HEAD:
        return pm
    return PointMap(pm.point, None, pm.reason or COMPILED)


def _shutdown(llm: Any) -> None:
    """Stops an engine's core (in this process), however broken it is."""
    if llm is None:
        return
    with contextlib.suppress(Exception):  # a broken engine: nothing of it to keep
        llm.llm_engine.engine_core.shutdown()


def _worker(worker: Any) -> Any:
    """The worker itself (the engine runs in this process)."""
    return worker


def _known(running: Running, dtype: str) -> KnownScale | None:
    """A known scale of the running model's kernels in ``dtype`` (``vllm_kernels``: the CPU
    fused MoE rounding toward zero), measured once per shape in a process."""
    points = {pm.point: pm.module for pm in running.mapping if pm.module is not None}
    return moe_scale(running.model, points, dtype)


def _unmapped(mapping: list[PointMap]) -> dict[str, str]:
    return {pm.point: pm.reason or "unmapped" for pm in mapping if pm.module is None}


def _variant(llm: Any, model: Any) -> str:
    """The engine as records name it: vLLM's version, attention backend, compilation."""
    import vllm

    config = llm.llm_engine.vllm_config
    eager = bool(config.model_config.enforce_eager)
    backend = "unknown"
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if impl is not None and type(module).__name__ == "Attention":
            backend = type(impl).__name__.removesuffix("Impl")
            break
    compiled = "eager" if eager else f"compiled-{config.compilation_config.mode}"
    return f"engine=vllm-{vllm.__version__},vllm-attention={backend},vllm-graph={compiled}"
