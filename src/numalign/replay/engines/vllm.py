"""The vLLM engine: a golden set replayed through vLLM's own model code, in this process.

Every row of every golden request is served as its real tokens (an engine never pads), all
together through vLLM's continuous batching with a small token budget per step, so long
prompts are prefilled in chunks beside other requests' decode steps. Rows of the set's
decode requests are teacher-forced with the golden tokens (a logits processor leaves the
sampler only the golden token), so each decode step runs in vLLM's paged KV cache and
compares like with like. Hooks on the mapped modules (``vllm_points``) read each row's
positions out of the flattened batch, and the engine's own logits computation gives the
full-vocabulary logits at every position. One serving per (set, dtype) feeds the model test
(every point and the logits of the prompts) and the decode test (every step's new token).

Modules that run alone (norms, MLPs, MoE blocks) are also replayed alone on the golden
inputs (layer replay, and locating a divergence); attention, which needs vLLM's forward
context (its attention metadata and KV cache), is skipped with that reason.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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
from numalign.replay.engines.vllm_points import (
    LM_HEAD,
    RESIDUAL,
    PointMap,
    map_points,
    reference_output,
    residual_output,
)
from numalign.replay.layer import AloneUnsupported, kept_positions, request_mask
from numalign.replay.model import hidden_and_depth, open_fresh
from numalign.runtime.variant import Variant

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet, Point
    from numalign.settings import Settings

#: vLLM in this process (its engine core in-process: hooks reach the model, nothing is
#: pickled) and its CPU threads left where the worker put them (xdist workers share cores).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
#: Tokens per engine step: the zoo's 16- and 24-token prompts are prefilled in chunks beside
#: other rows' decode steps (continuous batching with chunked prefill).
MAX_BATCH_TOKENS = 32
#: Rows served at once (the zoo's sets have 8 rows).
MAX_ROWS = 16
#: How long serving a set may take before the replay gives up (a hung engine must not hang
#: the session): the zoo's sets take about a second.
SERVE_TIMEOUT_S = 300.0
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
#: The row id and forced tokens travel in each request's sampling parameters.
ROW_KEY, FORCED_KEY = "numalign_row", "numalign_forced"


@dataclass
class _Running:
    """One started engine: the set and dtype it serves, the LLM, its model and runner."""

    key: tuple[str, str]
    llm: Any
    model: Any
    runner: Any
    mapping: list[PointMap]
    variant: str


@dataclass
class _Served:
    """What the engine computed per row: each mapped point's output and the logits, by
    position (prompt positions, then one per decode step), and the order in which the
    points' hooks first fired (children before their parents, as the reference's)."""

    chunks: dict[tuple[str, str], dict[int, Any]] = field(default_factory=dict)
    order: dict[str, int] = field(default_factory=dict)
    layout: list[tuple[str, int, int, int]] = field(default_factory=list)

    def add(self, row: str, point: str, first: int, tensor: Any) -> None:
        slots = self.chunks.setdefault((row, point), {})
        for i in range(tensor.shape[0]):  # a recomputed position keeps the latest
            slots[first + i] = tensor[i]
        self.order.setdefault(point, len(self.order))

    def positions(self, row: str, point: str, start: int, stop: int) -> Any:
        """The row's output of ``point`` at positions [start, stop): [stop - start, ...]."""
        import torch

        slots = self.chunks.get((row, point), {})
        missing = [p for p in range(start, stop) if p not in slots]
        if missing:
            raise EngineError(
                f"vLLM never computed {point} at positions {missing[:5]} of row {row} "
                "(preempted, or served from a prefix cache)"
            )
        return torch.stack([slots[p] for p in range(start, stop)])


class VllmEngine:
    name = "vllm"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._running: _Running | None = None
        self._served: dict[tuple[str, str], _Served] = {}
        #: sets vLLM does not serve, with its reason (not started again for each test)
        self._unsupported: dict[str, str] = {}

    @staticmethod
    def caches(settings: Settings) -> tuple[str, ...]:
        """vLLM decodes in its own paged KV cache."""
        return ("paged",)

    # -- the three replays -------------------------------------------------------------

    def model(self, path: str | Path, dtype: str, device: torch.device, policy: Any) -> Replayed:
        golden = open_fresh(path)
        running = self._engine(golden, dtype)
        served = self._serve(golden, dtype)
        unmapped = _unmapped(running.mapping)
        # the engine's model replay pools no leans (as before the one judge; see docs/vllm.md)
        judge = Judge.of_set(golden, dtype, "accumulated", hidden_and_depth_of(running), policy,
                         leans=False)  # fmt: skip
        verdict = ModelVerdict(points=judge.points, logits=judge.logits)
        torch_dtype = dtypes.torch_dtype(dtype)
        for request in golden.requests:
            rows = _rows(golden, request.name)
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
                    actual = _prompt_rows(served, rows, pm.module)
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
            _residuals(judge, served, golden, request.name, rows, running.mapping, torch_dtype)
            finals = golden.final_outputs(request.name)
            if "logits" in finals:
                expected = kept_positions(golden.tensor(finals["logits"]), mask)
                actual = _prompt_rows(served, rows, OUTPUT_POINT).to(torch_dtype)
                judge.judge_logits(request.name, actual, expected)
        verdict.divergence = self._locate(golden, dtype, verdict.points, policy)
        verdict.unmapped = unmapped
        return Replayed(golden, verdict, self._context(golden, running))

    def decode(
        self, path: str | Path, dtype: str, cache: str, device: torch.device, policy: Any
    ) -> Replayed:
        golden = open_fresh(path)
        require_decode_calibration(golden, dtype)
        reason = decode_unavailable(golden, dtype)
        if reason is not None:
            return Replayed(golden, None, skipped=reason)
        running = self._engine(golden, dtype)
        served = self._serve(golden, dtype)
        unmapped = _unmapped(running.mapping)
        judge = Judge.of_set(golden, dtype, "decode", hidden_and_depth_of(running), policy,
                         leans=False)  # fmt: skip
        verdict = DecodeVerdict(cache, points=judge.points, logits=judge.logits)
        torch_dtype = dtypes.torch_dtype(dtype)
        modules = {pm.point: pm.module for pm in running.mapping if pm.module is not None}
        for request in golden.decode_requests:
            rows = _rows(golden, request)
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
                        actual = _step_rows(served, rows, modules[point], number)
                        judge.observe(Observation(
                            point, path, request, actual.to(torch_dtype), golden.tensor(key),
                            step=number, finished=served.order.get(modules[point], 0),
                        ))  # fmt: skip
                logits = _step_rows(served, rows, OUTPUT_POINT, number)[:, 0]
                judge.judge_logits(request, logits.to(torch_dtype), golden.tensor(step.logits),
                                   step=number)  # fmt: skip
        verdict.unmapped = unmapped
        context = self._context(golden, running, cache)
        return Replayed(golden, verdict, context)

    def layer(
        self, path: str | Path, point: str, dtype: str, device: torch.device, policy: Any
    ) -> Replayed:
        golden = open_fresh(path)
        running = self._engine(golden, dtype)
        pm = next(m for m in running.mapping if m.point == point)
        context = self._context(golden, running)
        if self.settings.compile_backend is not None:
            return Replayed(golden, [], context, skipped=COMPILED)
        if pm.module is None:
            return Replayed(golden, [], context, skipped=f"unmapped: {pm.reason}")
        try:
            results = _isolated(running, golden, golden.point(point), pm.module, dtype, policy)
        except AloneUnsupported as exc:
            return Replayed(golden, [], context, skipped=str(exc))
        return Replayed(golden, results, context)

    def close(self) -> None:
        self._stop()

    # -- the engine ------------------------------------------------------------------

    def _engine(self, golden: GoldenSet, dtype: str) -> _Running:
        """The engine serving ``golden`` in ``dtype``, started if it is not the running one
        (one engine per worker at a time: each holds its share of the memory)."""
        key = (str(golden.path), dtype)
        reason = self._unsupported.get(str(golden.path))
        if reason is not None:
            raise EngineUnsupported(reason)
        if self._running is not None and self._running.key == key:
            return self._running
        self._stop()
        self._running = self._start(golden, dtype)
        return self._running

    def _start(self, golden: GoldenSet, dtype: str) -> _Running:
        os.environ.update(ENGINE_ENV)
        capped = _onednn_capped_below(dtype)
        if capped is not None:
            raise EngineUnsupported(f"vLLM does not serve {golden.name} in {dtype} here: {capped}")
        _allow_amx()
        length = max(_row_lengths(golden), default=16) + _decode_steps(golden) + 2
        llm = None
        try:
            with _quiet():
                from vllm import LLM, SamplingParams
                from vllm.inputs import TokensPrompt

                llm = LLM(
                    model=str(golden.model_dir), skip_tokenizer_init=True, dtype=dtype,
                    gpu_memory_utilization=self.settings.vllm_memory, max_model_len=length,
                    kv_cache_memory_bytes=_kv_cache_bytes(golden, dtype),
                    max_num_batched_tokens=MAX_BATCH_TOKENS, max_num_seqs=MAX_ROWS,
                    enable_prefix_caching=False,
                    enforce_eager=self.settings.compile_backend is None,
                    logits_processors=[_forcing_processor()], seed=0,
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
        with _quiet():
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
        return _Running((str(golden.path), dtype), llm, model, runner, mapping,
                        _variant(llm, model))  # fmt: skip

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
        self, golden: GoldenSet, running: _Running, cache: str | None = None
    ) -> dict[str, Any]:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type or "cpu")
        variant = Variant.from_settings(
            self.settings, device=device, dtype=running.key[1], cache=cache
        ).with_changes(engine_variant=running.variant)
        return {"suite": "models", "candidate": "vllm", "device": device,
                "golden_fingerprint": golden.model.fingerprint, "model": golden.name,
                **variant.record_fields()}  # fmt: skip

    # -- serving -----------------------------------------------------------------------

    def _serve(self, golden: GoldenSet, dtype: str) -> _Served:
        """Every row of the set served once (cached for the running engine)."""
        key = (str(golden.path), dtype)
        if key not in self._served:
            running = self._engine(golden, dtype)
            try:
                self._served[key] = _serve_rows(running, golden)
            except EngineError:
                self._stop()
                raise
            except Exception as exc:
                failure = self._failure(golden, exc, "serve")
                self._stop()
                raise failure from None
        return self._served[key]

    def _locate(
        self, golden: GoldenSet, dtype: str, results: list[PointResult], policy: Any
    ) -> Divergence | None:
        """The first divergence, located by the judge with the points' vLLM modules replayed
        alone."""
        return locate(results, _AloneOnVllm(self._engine(golden, dtype), golden, dtype, policy))


@dataclass
class _AloneOnVllm:
    """vLLM's modules replayed alone on the golden inputs, for the judge to locate a
    divergence (``compare.locate.Alone``); the model's own inputs are not taken."""

    running: _Running
    golden: GoldenSet
    dtype: str
    policy: Any

    def replay_alone(self, point: str) -> list[PointResult]:
        module = next((m.module for m in self.running.mapping if m.point == point), None)
        if point not in {p.name for p in self.golden.points}:
            raise AloneUnsupported(f"the set has no point {point}")
        return _isolated(self.running, self.golden, self.golden.point(point), module or "",
                         self.dtype, self.policy)  # fmt: skip

    def inputs_at_fault(self, failing: PointResult) -> None:
        return None


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


def hidden_and_depth_of(running: _Running) -> tuple[int, int]:
    hidden, depth = hidden_and_depth(running.model)
    return hidden, depth


def _rows(golden: GoldenSet, request: str) -> list[tuple[str, int]] | None:
    """The engine rows of a golden request: (row id, prompt length) per batch row; None for
    an image request (vLLM is served token ids only here)."""
    inputs = golden.request(request).inputs
    if unservable(inputs):
        return None
    mask = request_mask(golden, request)
    ids = golden.tensor(inputs["input_ids"])
    lengths = mask.sum(-1).tolist() if mask is not None else [ids.shape[1]] * ids.shape[0]
    return [(f"{request}#{b}", int(n)) for b, n in enumerate(lengths)]


def _row_lengths(golden: GoldenSet) -> list[int]:
    return [n for r in golden.requests for _, n in (_rows(golden, r.name) or [])]


def _kv_cache_bytes(golden: GoldenSet, dtype: str) -> int:
    """The KV cache the set's rows need (keys and values of every layer for every position
    served, each row rounded up to whole pages of 16 tokens), KV_MARGIN times over, at least
    KV_FLOOR_BYTES."""
    import json

    config = json.loads((golden.model_dir / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size") or 64) // heads)
    layers = int(config.get("num_hidden_layers") or 1)
    steps = _decode_steps(golden) + 1
    tokens = sum(-(-(n + steps) // 16) * 16 + 16 for n in _row_lengths(golden))
    per_token = 2 * layers * kv_heads * head_dim * int(dtypes.torch_dtype(dtype).itemsize)
    return max(KV_FLOOR_BYTES, KV_MARGIN * tokens * per_token)


def _decode_steps(golden: GoldenSet) -> int:
    steps = [len(d.steps) for r in golden.decode_requests if (d := golden.decode(r))]
    return max(steps, default=0)


def _prompt_rows(served: _Served, rows: list[tuple[str, int]], point: str) -> Any:
    """The rows' outputs at their prompt positions, concatenated ([kept positions, ...], as
    ``kept_positions`` lays out the reference's)."""
    import torch

    return torch.cat([served.positions(row, point, 0, n) for row, n in rows])


def _step_rows(served: _Served, rows: list[tuple[str, int]], point: str, step: int) -> Any:
    """The rows' outputs for decode step ``step`` ([batch, 1, ...], as a golden step)."""
    import torch

    # step 1 feeds the first generated token, at the position after the prompt
    return torch.stack([served.positions(row, point, n + step - 1, n + step) for row, n in rows])


def _serve_rows(running: _Running, golden: GoldenSet, decode: bool = True) -> _Served:
    """Serves every row of every golden request (decode requests' rows teacher-forced with
    their golden tokens; with ``decode`` False, the prompts alone) and collects each mapped
    point's output and the logits per row and position."""
    import torch

    prompts, params = row_requests(golden, decode)
    served = _Served()
    with _quiet(), _hooked(running, served), torch.no_grad():
        finished = _run(running.llm.llm_engine, prompts, params, golden.name)
    if finished != len(prompts):
        raise EngineError(f"vLLM finished {finished} of {len(prompts)} requests of {golden.name}")
    return served


def row_requests(
    golden: GoldenSet, decode: bool = True, observed: bool = True
) -> tuple[list[Any], list[Any]]:
    """vLLM's prompts and sampling parameters for every row of every golden request: its real
    tokens, one token more than the row's decode steps (none with ``decode`` False), greedy.
    ``observed``: each request names its row and the golden tokens to force (the replay);
    otherwise the same requests as a user would send them (the benchmark's plain serving)."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    forced: dict[str, list[int]] = {}
    for name in golden.decode_requests if decode else ():
        recorded = golden.decode(name)
        if recorded is None or not recorded.steps:
            continue
        tokens = torch.cat([golden.tensor(s.token) for s in recorded.steps], dim=1)
        for b in range(tokens.shape[0]):
            forced[f"{name}#{b}"] = tokens[b].tolist()
    prompts, params = [], []
    for request in golden.requests:
        rows = _rows(golden, request.name)
        if rows is None:
            continue
        ids = golden.tensor(request.inputs["input_ids"])
        mask = request_mask(golden, request.name)
        for b, (row, _) in enumerate(rows):
            tokens = ids[b][mask[b].bool()] if mask is not None else ids[b]
            prompts.append(TokensPrompt(prompt_token_ids=tokens.tolist()))
            steps = forced.get(row, [])
            extra = {ROW_KEY: row, FORCED_KEY: steps} if observed else None
            params.append(SamplingParams(
                max_tokens=len(steps) + 1, temperature=0.0, detokenize=False, extra_args=extra,
                ignore_eos=True,
            ))  # fmt: skip
    return prompts, params


def _run(engine: Any, prompts: list[Any], params: list[Any], name: str) -> int:
    """Serves the requests step by step, giving up (the engine hung or is far too slow)
    after SERVE_TIMEOUT_S; the number of requests finished."""
    for i, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"numalign-{i}", prompt, param)
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    finished = 0
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise EngineError(
                f"vLLM served {finished} of {len(prompts)} requests of {name} in "
                f"{SERVE_TIMEOUT_S:.0f} s; it hung or is far too slow",
                crashed=True,
            )
        finished += sum(1 for out in engine.step() if out.finished)
    return finished


@contextmanager
def _hooked(running: _Running, served: _Served) -> Iterator[None]:
    """Hooks that read each row's positions out of the flattened batch: the batch's layout
    (which request's tokens, at which positions) from the runner at each forward, each mapped
    module's reference output, and the logits from the engine's own logits computation."""
    runner, model = running.runner, running.model
    scheduled: dict[str, int] = {}
    execute = runner.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        scheduled.clear()
        scheduled.update(scheduler_output.num_scheduled_tokens)
        return execute(scheduler_output, *args, **kwargs)

    def before(module: Any, args: Any, kwargs: Any) -> None:
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        served.layout, start = [], 0
        for rid in runner.input_batch.req_ids:
            count = scheduled.get(rid, 0)
            row = runner.requests[rid].sampling_params.extra_args[ROW_KEY]
            served.layout.append((row, start, count, int(positions[start]) if count else 0))
            start += count

    def keep(point: str, tensor: Any) -> None:
        for row, start, count, first in served.layout:
            if count:
                served.add(row, point, first, tensor[start : start + count].detach().float().cpu())

    def after(module: Any, args: Any, output: Any) -> None:
        import torch

        if isinstance(output, torch.Tensor):  # the final hidden states: the engine's logits
            logits = model.compute_logits(output[: sum(c for *_, c, _ in served.layout)])
            keep(OUTPUT_POINT, logits)

    handles = [model.register_forward_pre_hook(before, with_kwargs=True)]
    for pm in running.mapping:
        if pm.module is None or pm.module == LM_HEAD:
            continue
        sub = model.get_submodule(pm.module)

        def on_output(m: Any, a: Any, out: Any, name: str = pm.module) -> None:
            tensor = reference_output(m, out)
            if tensor is not None:
                keep(name, tensor)
            residual = residual_output(m, out)
            if residual is not None:
                keep(f"{name}.{RESIDUAL}", residual)

        handles.append(sub.register_forward_hook(on_output))
    handles.append(model.register_forward_hook(after))
    runner.execute_model = execute_model
    try:
        yield
    finally:
        runner.execute_model = execute
        for handle in handles:
            handle.remove()
        served.order.setdefault(LM_HEAD, served.order.get(OUTPUT_POINT, len(served.order)))
        served.chunks.update({
            (row, LM_HEAD): slots for (row, point), slots in list(served.chunks.items())
            if point == OUTPUT_POINT
        })  # fmt: skip


def _isolated(
    running: _Running, golden: GoldenSet, point: Point, module_name: str, dtype: str, policy: Any
) -> list[PointResult]:
    """Every recorded call of ``point`` run alone through vLLM's ``module_name`` on the golden
    inputs (their kept positions, flattened as vLLM's tokens), against the isolated
    calibration; AloneUnsupported saying why where the module cannot run alone."""
    import torch
    from vllm.forward_context import set_forward_context

    if not module_name:
        raise AloneUnsupported(f"{point.name} has no vLLM module")
    model = running.model
    # the head alone is the engine's logits computation on the head's input
    module = _LogitsOf(model) if module_name == LM_HEAD else model.get_submodule(module_name)
    attention = [n for n, m in module.named_modules() if type(m).__name__ == "Attention"]
    if attention:
        raise AloneUnsupported(
            f"vLLM's {module_name} runs attention, which needs the engine's forward context "
            "(attention metadata and KV cache): replayed in the full model only"
        )
    judge = Judge.of_set(golden, dtype, "isolated", hidden_and_depth_of(running), policy)
    torch_dtype = dtypes.torch_dtype(dtype)
    for request, calls in point.calls.items():
        if "pixel_values" in golden.request(request).inputs:
            continue
        mask = request_mask(golden, request)
        for call in calls:
            key = (
                call.args[0]
                if call.args and call.args[0] is not None
                else call.kwargs.get("hidden_states")
            )
            if not isinstance(key, str):
                raise AloneUnsupported(
                    f"the golden call of {point.name} has no hidden-states input to feed "
                    f"vLLM's {module_name}"
                )
            x = _tokens(golden.tensor(key), mask)
            x = x.to(torch_dtype) if x.is_floating_point() else x
            try:  # an empty forward context: MoE layers read theirs (no attention runs)
                with (
                    torch.no_grad(),
                    _quiet(),
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
            expected = _tokens(golden.tensor(call.outputs["0"]), mask)
            actual = out.detach().float().to(torch_dtype)
            judge.observe(Observation(point.name, "0", request, actual, expected, finished=0))
            stream = _fused_residual(module, x, running)
            if stream is not None:  # the fused add of the stream and zeros gives the stream
                judge.observe(Observation(
                    point.name, RESIDUAL, request, stream.to(torch_dtype), x, finished=0,
                    control_of=(point.name, "0"),
                ))  # fmt: skip
    return judge.points + judge.pooled()


def _fused_residual(module: Any, x: Any, running: _Running) -> Any:
    """A fused add + norm run alone on (the stream, zeros): the residual stream it returns,
    which must be the stream itself; None for modules that are not fused norms."""
    import torch
    from vllm.forward_context import set_forward_context

    if "norm" not in type(module).__name__.lower() or not x.is_floating_point():
        return None
    config = running.llm.llm_engine.vllm_config
    try:
        with torch.no_grad(), _quiet(), set_forward_context(None, config):
            out = module(x.clone(), torch.zeros_like(x))
    except TypeError:  # a norm that takes no residual
        return None
    residual = residual_output(module, out)
    return None if residual is None else residual.detach().float()


def _residuals(
    judge: Judge,
    served: _Served,
    golden: GoldenSet,
    request: str,
    rows: list[tuple[str, int]],
    mapping: list[PointMap],
    torch_dtype: Any,
) -> None:
    """Each fused add + norm's residual stream against the reference norm's input (the
    stream entering it), within the accumulated budget of the block that holds the norm (the
    stream's error at that depth), handed to ``judge``; norms outside a captured block are
    not judged so."""
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
        expected = kept_positions(golden.tensor(key), request_mask(golden, request))
        actual = _prompt_rows(served, rows, name).to(torch_dtype)
        judge.observe(Observation(pm.point, RESIDUAL, request, actual, expected,
                                  finished=served.order.get(name, 0),
                                  control_of=(parent, "0")))  # fmt: skip


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


def _forcing_processor() -> Any:
    """A vLLM logits processor class that leaves the sampler only the row's golden token at
    each decode step (teacher forcing); rows without forced tokens are left alone."""
    import torch
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ForceGoldenTokens(AdapterLogitsProcessor):  # type: ignore[misc]
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params: Any) -> Any:
            tokens = (params.extra_args or {}).get(FORCED_KEY)
            if not tokens:
                return None

            def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
                step = len(output_ids)
                if step >= len(tokens):
                    return logits
                forced = torch.full_like(logits, float("-inf"))
                forced[tokens[step]] = 0.0
                return forced

            return force

    return ForceGoldenTokens


@contextmanager
def _quiet() -> Iterator[None]:
    """vLLM's loggers at warnings while it runs (it logs every step of its start-up), and
    the deprecation warnings its imports and start-up raise (vLLM's and torch's own, which a
    session's ``-W error`` would turn into failures of numalign's tests) ignored."""
    import logging
    import warnings

    log = logging.getLogger("vllm")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        log.setLevel(level)
