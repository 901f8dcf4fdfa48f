"""Serving a golden set through vLLM for the replay: every row of every golden request as
its real tokens, decode rows teacher-forced with the golden tokens (a logits processor), and
hooks that read each row's positions of every mapped module's output and the logits out of
vLLM's flattened batches (``Served``), in one of the serving arrangements
(``numalign.runtime.serving``), with what the scheduler was seen doing (``Exercised``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from numalign.golden.manifest import OUTPUT_POINT
from numalign.golden.requests import SERVING_BLOCK, unservable
from numalign.replay.engines import vllm_drafts
from numalign.replay.engines.errors import EngineError, EngineUnsupported
from numalign.replay.engines.vllm_points import (
    LM_HEAD,
    RESIDUAL,
    PointMap,
    reference_output,
    residual_output,
)
from numalign.replay.layer import request_mask
from numalign.replay.model import hidden_and_depth
from numalign.runtime.serving import CROWD_ROWS, Arrangement

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet


#: How long serving a set may take before the replay gives up (a hung engine must not hang
#: the session): the zoo's sets take about a second.
SERVE_TIMEOUT_S = 300.0


#: The row id and forced tokens travel in each request's sampling parameters.
ROW_KEY, FORCED_KEY = "numalign_row", vllm_drafts.FORCED_KEY


@dataclass
class Running:
    """One started engine: the set, dtype and engine configuration it serves (``key``), the
    LLM, its model and runner, the points' modules, the engine as records name it, and the
    serving arrangement it was started for."""

    key: tuple[str, str, tuple[Any, ...]]
    llm: Any
    model: Any
    runner: Any
    mapping: list[PointMap]
    variant: str
    arrangement: Arrangement


@dataclass
class Exercised:
    """What vLLM's scheduler was seen doing while it served a set: its steps, the most rows
    one step ran, the prompts it prefilled over more than one step, the prompt tokens it
    took from the prefix cache, the rows it preempted (counted as they resume), and the
    drafted tokens it verified."""

    steps: int = 0
    most_rows: int = 0
    chunked_prompts: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    drafted_tokens: int = 0

    def saw(self, scheduler_output: Any) -> None:
        scheduled = scheduler_output.num_scheduled_tokens
        self.steps += 1
        self.most_rows = max(self.most_rows, len(scheduled))
        for new in scheduler_output.scheduled_new_reqs:
            self.prefix_hit_tokens += int(new.num_computed_tokens)
            left = len(new.prompt_token_ids or ()) - int(new.num_computed_tokens)
            if scheduled.get(new.req_id, 0) < left:
                self.chunked_prompts += 1
        # a preempted row comes back (its blocks recomputed) as a resumed request: vLLM
        # 0.32 names them; earlier versions flag each cached request
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None)
        if resumed is None:
            resumed = [r for r in getattr(cached, "resumed_from_preemption", ()) if r]
        self.preemptions += len(resumed)
        drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        self.drafted_tokens += sum(len(d) for d in drafts.values())

    def unexercised(self, arrangement: Arrangement, set_name: str, rows: list[int]) -> str | None:
        """Why the serving did not exercise what ``arrangement`` is for (None: it did)."""
        need = arrangement.exercises
        if need is None:
            return None
        if need == "crowd":
            seen, wanted = self.most_rows, arrangement.rows or CROWD_ROWS
            if seen >= wanted:
                return None
            return f"vLLM ran at most {seen} rows in one step, not the {wanted} asked for"
        if getattr(self, need) > 0:
            return None
        longest = max(rows, default=0)
        if need == "chunked_prompts":
            return (
                f"vLLM prefilled no prompt in chunks while serving {set_name} "
                f"{arrangement.name}: its rows have at most {longest} tokens, within one step's "
                f"budget of {arrangement.batch_tokens}"
            )
        if need == "drafted_tokens":
            return (
                f"vLLM verified no drafted token while serving {set_name} {arrangement.name}: "
                "the set records no decode steps to draft"
            )
        what = "served no prompt token from its prefix cache" if need == "prefix_hit_tokens" else (
            "preempted no row"
        )  # fmt: skip
        return (
            f"vLLM {what} while serving {set_name} {arrangement.name} (its rows have at most "
            f"{longest} tokens; the prefix cache and preemption work in whole KV blocks, "
            f"{KV_BLOCK} tokens here, and a sliding window frees the blocks it leaves behind, "
            "so a windowed model's rows rarely compete for blocks): capture the set with "
            f"longer requests (numalign capture --long {2 * KV_BLOCK + KV_BLOCK // 4}: rows "
            "past two blocks), then replay again"
        )


#: The KV cache's block (page) size numalign asks vLLM for on the CPU: the smallest its CPU
#: attention takes (it raises 16 to 32), the one a set's long requests cross (vLLM's CPU
#: default is 128, which no zoo request fills).
KV_BLOCK = SERVING_BLOCK


@dataclass
class Served:
    """What the engine computed per row: each mapped point's output and the logits, by
    position (prompt positions, then one per decode step), and the order in which the
    points' hooks first fired (children before their parents, as the reference's)."""

    chunks: dict[tuple[str, str], dict[int, Any]] = field(default_factory=dict)
    order: dict[str, int] = field(default_factory=dict)
    layout: list[tuple[str, int, int, int]] = field(default_factory=list)
    exercised: Exercised = field(default_factory=Exercised)
    #: a position computed again keeps its first value (speculative decoding: the first
    #: verification computed it on the golden drafts; a later one, after a rejected draft,
    #: on the row's own token)
    keep_first: bool = False

    def add(self, row: str, point: str, first: int, tensor: Any) -> None:
        slots = self.chunks.setdefault((row, point), {})
        for i in range(tensor.shape[0]):  # a recomputed position keeps the latest
            if not (self.keep_first and first + i in slots):
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


def hidden_and_depth_of(running: Running) -> tuple[int, int]:
    hidden, depth = hidden_and_depth(running.model)
    return hidden, depth


def engine_rows(golden: GoldenSet, request: str) -> list[tuple[str, int]] | None:
    """The engine rows of a golden request: (row id, prompt length) per batch row; None for
    an image request (vLLM is served token ids only here)."""
    inputs = golden.request(request).inputs
    if unservable(inputs, golden.tensor):
        return None
    mask = request_mask(golden, request)
    ids = golden.tensor(inputs["input_ids"])
    lengths = mask.sum(-1).tolist() if mask is not None else [ids.shape[1]] * ids.shape[0]
    return [(f"{request}#{b}", int(n)) for b, n in enumerate(lengths)]


def row_lengths(golden: GoldenSet) -> list[int]:
    return [n for r in golden.requests for _, n in (engine_rows(golden, r.name) or [])]


def decode_step_count(golden: GoldenSet) -> int:
    steps = [len(d.steps) for r in golden.decode_requests if (d := golden.decode(r))]
    return max(steps, default=0)


def prompt_rows(served: Served, rows: list[tuple[str, int]], point: str) -> Any:
    """The rows' outputs at their prompt positions, concatenated ([kept positions, ...], as
    ``kept_positions`` lays out the reference's)."""
    import torch

    return torch.cat([served.positions(row, point, 0, n) for row, n in rows])


def step_rows(served: Served, rows: list[tuple[str, int]], point: str, step: int) -> Any:
    """The rows' outputs for decode step ``step`` ([batch, 1, ...], as a golden step)."""
    import torch

    # step 1 feeds the first generated token, at the position after the prompt
    return torch.stack([served.positions(row, point, n + step - 1, n + step) for row, n in rows])


def serve_rows(
    running: Running,
    golden: GoldenSet,
    arrangement: Arrangement,
    decode: bool = True,
    also: Callable[[Served], AbstractContextManager[Any]] | None = None,
) -> Served:
    """Serves every row of every golden request in ``arrangement`` (decode requests' rows
    teacher-forced with their golden tokens; with ``decode`` False, the prompts alone) and
    collects each mapped point's output and the logits per row and position; ``also``: a
    context entered while serving, given what is being served (a module's input replaced:
    ``vllm_in_context``)."""
    import torch

    prompts, params = row_requests(golden, decode, prefill_scored=arrangement.prefill_scored)
    if arrangement.crowded:
        prompts, params = _crowd(prompts, params, arrangement.rows or CROWD_ROWS)
    requests = list(zip(prompts, params, strict=True))
    rounds = [[r] for r in requests] if arrangement.alone else [requests]
    if arrangement.prefix_cached:  # every row computed whole and cached, then served again
        cold = [(p, _copy(q, skip_reading_prefix_cache=True)) for p, q in requests]
        rounds = [cold, requests]
    served = Served(keep_first=arrangement.speculative)
    drafting = _golden_drafts(running) if arrangement.speculative else contextlib.nullcontext()
    extra = also(served) if also is not None else contextlib.nullcontext()
    with quiet(), _hooked(running, served), drafting, extra, torch.no_grad():
        for number, served_round in enumerate(rounds):
            chosen = [p for p, _ in served_round], [q for _, q in served_round]
            tokens = _run(running.llm.llm_engine, *chosen, golden.name, f"r{number}-")
            if len(tokens) != len(served_round):
                raise EngineError(
                    f"vLLM finished {len(tokens)} of {len(served_round)} requests of {golden.name}"
                )
            if arrangement.speculative:
                _check_golden_path(tokens, chosen[1], golden.name)
    return served


@contextmanager
def _golden_drafts(running: Running) -> Iterator[None]:
    """The engine's draft proposer (``vllm_drafts.GoldenDrafts``) handed the runner, whose
    batch says which golden row each of its rows is, while the set is served."""
    drafter = running.runner.drafter
    drafter.runner = running.runner
    try:
        yield
    finally:
        drafter.runner = None


def _check_golden_path(tokens: dict[int, list[int]], params: list[Any], name: str) -> None:
    """Unforced rows (speculative decoding) must have generated the golden first token: it is
    the input of the first decode step, and the first verification computes every step on it
    and the golden drafts (EngineUnsupported naming the row where the engine's own greedy
    token differs: the model test judges the logits that chose it)."""
    for index, param in enumerate(params):
        extra = param.extra_args or {}
        golden, made = list(extra.get(FORCED_KEY) or []), tokens.get(index, [])
        if golden and made[:1] != golden[:1]:
            raise EngineUnsupported(
                f"vLLM's greedy first token of {extra.get(ROW_KEY)} of {name} is "
                f"{made[:1]}, the golden one {golden[0]}: the speculative arrangement cannot "
                "force it (vLLM takes no logits processor with speculative decoding), and "
                "every decode step reads it; the model test judges the logits that chose it"
            )


def _copy(params: Any, **changes: Any) -> Any:
    """A copy of a request's sampling parameters with ``changes``."""
    import copy

    copied = copy.deepcopy(params)
    for name, value in changes.items():
        setattr(copied, name, value)
    return copied


def _crowd(prompts: list[Any], params: list[Any], rows: int) -> tuple[list[Any], list[Any]]:
    """The golden rows followed by copies of themselves, ``rows`` in all: the copies run the
    same tokens beside them (recorded under their own row names, never judged)."""
    prompts, params = list(prompts), list(params)
    for k in range(len(prompts), rows):
        param = _copy(params[k % len(params)])
        param.extra_args[ROW_KEY] = f"{param.extra_args[ROW_KEY]} (copy {k})"
        prompts.append(prompts[k % len(prompts)])
        params.append(param)
    return prompts, params


def row_requests(
    golden: GoldenSet, decode: bool = True, observed: bool = True, prefill_scored: bool = False
) -> tuple[list[Any], list[Any]]:
    """vLLM's prompts and sampling parameters for every row of every golden request: its real
    tokens, one token more than the row's decode steps (none with ``decode`` False), greedy.
    ``observed``: each request names its row and the golden tokens to force (the replay);
    otherwise the same requests as a user would send them (the benchmark's plain serving).
    ``prefill_scored``: the golden decode tokens appended to the prompt instead, one token
    generated (each decode step's position computed by the prefill)."""
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
        rows = engine_rows(golden, request.name)
        if rows is None:
            continue
        ids = golden.tensor(request.inputs["input_ids"])
        mask = request_mask(golden, request.name)
        for b, (row, _) in enumerate(rows):
            tokens = ids[b][mask[b].bool()] if mask is not None else ids[b]
            steps = forced.get(row, [])
            if prefill_scored:
                tokens, steps = torch.cat([tokens, torch.tensor(steps, dtype=tokens.dtype)]), []
            prompts.append(TokensPrompt(prompt_token_ids=tokens.tolist()))
            extra = {ROW_KEY: row, FORCED_KEY: steps} if observed else None
            params.append(SamplingParams(
                max_tokens=len(steps) + 1, temperature=0.0, detokenize=False, extra_args=extra,
                ignore_eos=True,
            ))  # fmt: skip
    return prompts, params


def _run(
    engine: Any, prompts: list[Any], params: list[Any], name: str, round_: str = ""
) -> dict[int, list[int]]:
    """Serves the requests step by step, giving up (the engine hung or is far too slow)
    after SERVE_TIMEOUT_S; the tokens each finished request generated, by its index.
    ``round_`` keeps request ids of one serving's rounds apart. Where serving stops on an
    error, the requests still in the engine are aborted, so that the engine, which the
    process keeps for the next test, is not left serving them forever."""
    prefix = f"numalign-{round_}"
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, prompt, param in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, param)
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    finished: dict[int, list[int]] = {}
    try:
        while engine.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise EngineError(
                    f"vLLM served {len(finished)} of {len(prompts)} requests of {name} in "
                    f"{SERVE_TIMEOUT_S:.0f} s; it hung or is far too slow",
                    crashed=True,
                )
            for out in engine.step():
                if out.finished:
                    index = int(str(out.request_id).removeprefix(prefix).split("-")[0])
                    finished[index] = list(out.outputs[0].token_ids)
    except BaseException:
        engine.abort_request([rid for i, rid in enumerate(ids) if i not in finished])
        raise
    return finished


@contextmanager
def _hooked(running: Running, served: Served) -> Iterator[None]:
    """Hooks that read each row's positions out of the flattened batch: the batch's layout
    (which request's tokens, at which positions) from the runner at each forward, each mapped
    module's reference output, and the logits from the engine's own logits computation."""
    runner, model = running.runner, running.model
    scheduled: dict[str, int] = {}
    execute = runner.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        scheduled.clear()
        scheduled.update(scheduler_output.num_scheduled_tokens)
        if scheduled:
            served.exercised.saw(scheduler_output)
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


def forcing_processor() -> Any:
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
def quiet() -> Iterator[None]:
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
