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
step's new token).

Modules that run alone (norms, MLPs, MoE blocks) are also replayed alone on the golden
inputs (layer replay, and locating a divergence); attention, which needs vLLM's forward
context (its attention metadata and KV cache), is skipped with that reason
(``vllm_alone``).
"""

from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign import dtypes
from numalign.compare.decode_verdict import DecodeVerdict
from numalign.compare.judge import Judge, Observation
from numalign.compare.locate import locate
from numalign.compare.model_verdict import (
    Divergence,
    ModelVerdict,
    PointResult,
    label,
)
from numalign.compare.routing import ROUTING
from numalign.golden.manifest import OUTPUT_POINT
from numalign.golden.requests import unservable
from numalign.replay.decode import decode_unavailable, require_decode_calibration
from numalign.replay.engines import Replayed
from numalign.replay.engines.errors import EngineError, EngineUnsupported
from numalign.replay.engines.vllm_alone import AloneOnVllm, isolated, judge_residuals
from numalign.replay.engines.vllm_drafts import GOLDEN_DRAFTS
from numalign.replay.engines.vllm_points import (
    LM_HEAD,
    PointMap,
    map_points,
)
from numalign.replay.engines.vllm_serving import (
    KV_BLOCK,
    Running,
    Served,
    decode_step_count,
    engine_rows,
    forcing_processor,
    hidden_and_depth_of,
    prompt_rows,
    quiet,
    row_lengths,
    serve_rows,
    step_rows,
)
from numalign.replay.layer import AloneUnsupported, kept_positions, request_mask
from numalign.replay.model import open_fresh
from numalign.runtime.variant import Variant
from numalign.serving import ARRANGEMENTS, DEFAULT_SERVING, Arrangement

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet
    from numalign.settings import Settings

#: vLLM in this process (its engine core in-process: hooks reach the model, nothing is
#: pickled) and its CPU threads left where the worker put them (xdist workers share cores).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


#: Tokens per engine step: the zoo's 16- and 24-token prompts are prefilled in chunks beside
#: other rows' decode steps (continuous batching with chunked prefill).
MAX_BATCH_TOKENS = 32


#: Rows served at once (the zoo's sets have 8 rows).
MAX_ROWS = 16


#: The KV cache a replay reserves: what its rows need, MARGIN times over, at least FLOOR (a
#: cache sized to the replay, not a share of the machine: on CPU vLLM's share counts the whole
#: process's memory, golden tensors and a previous engine's pages included).
KV_MARGIN, KV_FLOOR_BYTES = 4, 64 << 20


#: vLLM's messages for a model or configuration it does not serve (the test skips with it).
UNSUPPORTED = ("Unsupported CPU attention", "not supported", "There is no module or parameter",
               "is not supported", "does not support", "do not support")  # fmt: skip


#: vLLM's message for a KV-cache share larger than the machine holds.
MEMORY = ("less than requested memory", "No available memory for the cache blocks",
          "Insufficient memory")  # fmt: skip


#: oneDNN's instruction sets in its order, as ``ONEDNN_MAX_CPU_ISA`` names them, and the
#: lowest that builds the bfloat16 GEMMs vLLM's CPU build asks it for.
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
               "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX10_1_512", "AVX10_1_512_AMX",
               "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")  # fmt: skip


ONEDNN_BF16_ISA = "AVX512_CORE_BF16"


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
        unmapped = _unmapped(running.mapping)
        # the engine's model replay pools no leans (as before the one judge; see docs/vllm.md)
        judge = Judge.of_set(golden, dtype, "accumulated", hidden_and_depth_of(running), policy,
                         leans=False)  # fmt: skip
        verdict = ModelVerdict(points=judge.points, logits=judge.logits)
        torch_dtype = dtypes.torch_dtype(dtype)
        for request in golden.requests:
            rows = engine_rows(golden, request.name)
            if rows is None:
                unmapped[f"request {request.name}"] = str(unservable(request.inputs))
                continue
            mask = request_mask(golden, request.name)
            for pm in running.mapping:
                if pm.module is None:
                    continue
                calls = golden.point(pm.point).calls.get(request.name)
                if not calls:  # the point does not run for this request
                    continue
                for path, key in calls[0].outputs.items():
                    if path != "0":
                        if golden.tensor(key).dim() < 4:  # attention weights: eager's only
                            unmapped.setdefault(label(pm.point, path),
                                                "vLLM's module returns no such output")  # fmt: skip
                        continue
                    expected = kept_positions(golden.tensor(key), mask)
                    actual = prompt_rows(served, rows, pm.module)
                    if tuple(actual.shape) != tuple(expected.shape):
                        unmapped[label(pm.point, path)] = (
                            f"vLLM's {pm.module} gives {tuple(actual.shape)}, the reference "
                            f"{tuple(expected.shape)}"
                        )
                        continue
                    judge.observe(Observation(
                        pm.point, path, request.name, actual.to(torch_dtype), expected,
                        finished=served.order.get(pm.module, 0),
                    ))  # fmt: skip
            judge_residuals(judge, served, golden, request.name, rows, running.mapping, torch_dtype)
            finals = golden.final_outputs(request.name)
            if "logits" in finals:
                expected = kept_positions(golden.tensor(finals["logits"]), mask)
                actual = prompt_rows(served, rows, OUTPUT_POINT).to(torch_dtype)
                judge.judge_logits(request.name, actual, expected)
        verdict.divergence = self._locate(golden, dtype, verdict.points, policy)
        verdict.unmapped = unmapped
        return Replayed(golden, verdict, self._context(golden, running, arrangement))

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
        require_decode_calibration(golden, dtype)
        reason = decode_unavailable(golden, dtype)
        if reason is not None:
            return Replayed(golden, None, skipped=reason)
        arrangement = ARRANGEMENTS[serving or DEFAULT_SERVING]
        running = self._engine(golden, dtype, arrangement)
        served = self._serve(golden, dtype, arrangement)
        unmapped = _unmapped(running.mapping)
        judge = Judge.of_set(golden, dtype, "decode", hidden_and_depth_of(running), policy,
                         leans=False)  # fmt: skip
        verdict = DecodeVerdict(cache, points=judge.points, logits=judge.logits)
        torch_dtype = dtypes.torch_dtype(dtype)
        modules = {pm.point: pm.module for pm in running.mapping if pm.module is not None}
        for request in golden.decode_requests:
            rows = engine_rows(golden, request)
            decode = golden.decode(request)
            if rows is None:
                unmapped[f"request {request}"] = str(unservable(golden.request(request).inputs))
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
                        judge.observe(Observation(
                            point, path, request, actual.to(torch_dtype), golden.tensor(key),
                            step=number, finished=served.order.get(modules[point], 0),
                        ))  # fmt: skip
                logits = step_rows(served, rows, OUTPUT_POINT, number)[:, 0]
                judge.judge_logits(request, logits.to(torch_dtype), golden.tensor(step.logits),
                                   step=number)  # fmt: skip
        verdict.unmapped = unmapped
        context = self._context(golden, running, arrangement, cache)
        return Replayed(golden, verdict, context)

    def layer(
        self, path: str | Path, point: str, dtype: str, device: torch.device, policy: Any
    ) -> Replayed:
        golden = open_fresh(path)
        running = self._engine(golden, dtype)
        pm = next(m for m in running.mapping if m.point == point)
        context = self._context(golden, running, ARRANGEMENTS[DEFAULT_SERVING])
        if self.settings.compile_backend is not None:
            return Replayed(golden, [], context, skipped=COMPILED)
        if pm.module is None:
            return Replayed(golden, [], context, skipped=f"unmapped: {pm.reason}")
        try:
            results = isolated(running, golden, golden.point(point), pm.module, dtype, policy)
        except AloneUnsupported as exc:
            return Replayed(golden, [], context, skipped=str(exc))
        return Replayed(golden, results, context)

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
        key = (str(golden.path), dtype, _configuration(arrangement))
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
        capped = _onednn_capped_below(dtype)
        if capped is not None:
            raise EngineUnsupported(f"vLLM does not serve {golden.name} in {dtype} here: {capped}")
        _allow_amx()
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
                    **_serving_options(golden, dtype, arrangement, length),
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
        key = (str(golden.path), dtype, _configuration(arrangement))
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

    def _locate(
        self, golden: GoldenSet, dtype: str, results: list[PointResult], policy: Any
    ) -> Divergence | None:
        """The first divergence, located by the judge with the points' vLLM modules replayed
        alone."""
        return locate(results, AloneOnVllm(self._engine(golden, dtype), golden, dtype, policy))


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


def _onednn_capped_below(dtype: str) -> str | None:
    """Why oneDNN, capped by ``ONEDNN_MAX_CPU_ISA``, cannot run vLLM's CPU GEMMs in
    ``dtype`` (None where it can): vLLM chooses its bfloat16 oneDNN kernels from the
    hardware, and below AVX512_CORE_BF16 oneDNN refuses to build them and the process aborts
    (vLLM 0.32.0; float32 and float16 run under any cap)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if dtype != "bfloat16" or cap not in ONEDNN_ISAS:
        return None
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":  # the cap is the CPU build's concern only
        return None
    if ONEDNN_ISAS.index(cap) >= ONEDNN_ISAS.index(ONEDNN_BF16_ISA):
        return None
    return (
        f"ONEDNN_MAX_CPU_ISA={cap} caps oneDNN below {ONEDNN_BF16_ISA}, which vLLM's CPU "
        "bfloat16 GEMMs need (they choose their kernels from the hardware, and the process "
        "aborts when oneDNN refuses them); replay bfloat16 through vLLM without the cap, "
        f"or with {ONEDNN_BF16_ISA} or above"
    )


def _allow_amx() -> None:
    """Asks Linux for the AMX tile state where the CPU has AMX. vLLM's CPU attention chooses
    its AMX kernel from the hardware alone and relies on oneDNN having asked for it; with
    oneDNN capped below AMX (``ONEDNN_MAX_CPU_ISA=AVX2``, as the honest matrix and the
    calibration members run) nobody asks, and the first attention kills the process with an
    illegal instruction (vLLM 0.32.0). Its own kernels do not follow the cap either way."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch._C._cpu._init_amx()


def _worker(worker: Any) -> Any:
    """The worker itself (the engine runs in this process)."""
    return worker


def _configuration(arrangement: Arrangement) -> tuple[Any, ...]:
    """What of ``arrangement`` the engine is started with (arrangements that agree on it share
    one running engine)."""
    return (arrangement.batch_tokens or MAX_BATCH_TOKENS, arrangement.rows or MAX_ROWS,
            arrangement.prefix_cached, arrangement.spare_blocks,
            arrangement.speculative)  # fmt: skip


def _serving_options(
    golden: GoldenSet, dtype: str, arrangement: Arrangement, length: int
) -> dict[str, Any]:
    """vLLM's engine options for ``arrangement``: the token budget and rows a step, the
    prefix cache, the KV block size (``KV_BLOCK`` on the CPU and where blocks are counted),
    the KV cache: sized to the replay, or for the preempted arrangement a number of blocks
    only slightly above what the longest row (``length`` tokens) needs; and the golden
    tokens forced (a logits processor) or, speculative, proposed as drafts."""
    from vllm.platforms import current_platform

    rows = arrangement.rows or MAX_ROWS
    copies = -(-rows // max(1, len(row_lengths(golden)))) if arrangement.crowded else 1
    options: dict[str, Any] = {
        # vLLM warns of a budget past what its rows can schedule: no more than that
        "max_num_batched_tokens": min(arrangement.batch_tokens or MAX_BATCH_TOKENS, rows * length),
        "max_num_seqs": rows,
        "enable_prefix_caching": arrangement.prefix_cached,
        "kv_cache_memory_bytes": _kv_cache_bytes(golden, dtype, copies),
    }
    # a GPU keeps its backend's block unless the arrangement counts blocks
    if current_platform.device_type == "cpu" or arrangement.spare_blocks is not None:
        options["block_size"] = KV_BLOCK
    if arrangement.speculative:
        # the golden tokens are the drafts (``vllm_drafts``): enough of them that one
        # verification covers every decode step after the first; the tokens are not forced,
        # as vLLM takes no logits processor with speculative decoding
        drafts = max(1, decode_step_count(golden) - 1)
        options["speculative_config"] = {"method": "custom_class", "model": GOLDEN_DRAFTS,
                                         "num_speculative_tokens": drafts}  # fmt: skip
    else:  # every decode row teacher-forced with the golden tokens
        options["logits_processors"] = [forcing_processor()]
    if arrangement.spare_blocks is not None:
        # and one block more: vLLM's block pool holds one back (its null block)
        blocks = -(-length // KV_BLOCK) + arrangement.spare_blocks + 1
        options["num_gpu_blocks_override"] = blocks
        # admitted on their first chunk alone (not their whole prompt), rows then compete
        # for blocks as their prefill goes on, and the scheduler preempts
        options["scheduler_reserve_full_isl"] = False
    return options


def _kv_cache_bytes(golden: GoldenSet, dtype: str, copies: int = 1) -> int:
    """The KV cache the set's rows need (keys and values of every layer for every position
    served, each row rounded up to whole blocks of ``KV_BLOCK`` tokens, and one block more),
    ``copies`` times (a crowded serving runs copies of the rows beside them) and KV_MARGIN
    times over, at least KV_FLOOR_BYTES."""
    import json

    config = json.loads((golden.model_dir / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size") or 64) // heads)
    layers = int(config.get("num_hidden_layers") or 1)
    steps = decode_step_count(golden) + 1
    tokens = sum(-(-(n + steps) // KV_BLOCK) * KV_BLOCK + KV_BLOCK for n in row_lengths(golden))
    per_token = 2 * layers * kv_heads * head_dim * int(dtypes.torch_dtype(dtype).itemsize)
    return max(KV_FLOOR_BYTES, KV_MARGIN * copies * tokens * per_token)


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
