"""Decode replay through transformers' paged serving engine (continuous batching with a paged
KV cache, ``paged|sdpa`` attention): every row of every golden decode request becomes an
engine request of its real tokens (an engine never pads; generation's positions make a padded
golden row comparable, see ``golden.reference.generation_positions``), all served together
with pages of ``REPLAY_PAGE_SIZE`` tokens and a small token budget per forward, so long
prompts are prefilled in chunks beside other requests' decode steps.

The engine is teacher-forced: a hook on the model's output keeps the logits it computed and
hands the sampler logits whose argmax is the golden token, so every step compares like with
like. Hooks on the capture points read each decode step's new-token rows out of the engine's
flattened batch ([1, tokens, hidden], requests concatenated in the order of the batch being
served). The cache's contents are the engine's pages, in its own layout: paged replay judges
the points and the logits of every step, not the cache's contents.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from numalign.compare.routing import ROUTING
from numalign.core.errors import Crashed, Unsupported
from numalign.golden.manifest import OUTPUT_POINT
from numalign.golden.reference import hooks, own_cache
from numalign.golden.requests import REPLAY_PAGE_SIZE, unservable
from numalign.golden.routing import point_tensors
from numalign.replay.layer import CallOrder
from numalign.runtime.compiled_model import CompiledModel

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet

#: The attention the paged engine runs (as ``paged|sdpa``); models without an SDPA path
#: (Gemma 2) run the engine's eager kernel (``paged|eager``) instead.
PAGED_ATTENTION = "sdpa"
#: Tokens per forward: two pages, so a long prompt is prefilled in chunks, batched with the
#: other requests' decode steps.
MAX_BATCH_TOKENS = 2 * REPLAY_PAGE_SIZE
#: How long the engine may take to serve a set's requests before the replay gives up (a
#: hung engine must not hang the session).
ENGINE_TIMEOUT_S = 300.0
#: What runs one replay through the paged engine: (request, step, point, path, actual,
#: expected), as ``replay.decode.run_decode`` hands on.
OnPair = Callable[..., None]


class PagedUnsupported(Unsupported, RuntimeError):
    """transformers' paged engine cannot serve this model (layer types its paged cache does
    not hold: linear attention, convolutions, hybrid or chunked layers; MLA's compressed cache;
    a model with a cache of its own; a compiled model): the paged replay is skipped with the
    reason."""


class PagedServingError(Crashed, RuntimeError):
    """The paged engine failed, or did not finish, serving the golden requests."""


def paged_unsupported(model: Any) -> str | None:
    """Why transformers' paged engine cannot serve ``model`` (None when it can)."""
    config = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    if isinstance(model, CompiledModel):
        return (
            "the paged engine runs the model's own forward, not numalign's compiled one "
            "(compile the engine with its own compile_config to serve compiled): --compile "
            "replays decode with the KV caches only"
        )
    if not hasattr(model, "init_continuous_batching"):
        return f"{name} has no continuous batching (init_continuous_batching)"
    try:
        getattr(config, "head_dim", None)
    except Exception as exc:  # a per-layer config refuses its global attributes
        return (
            f"{name}'s config holds head_dim per layer, and transformers' paged cache reads the "
            f"global one ({type(exc).__name__}: {str(exc).split('. ')[0]})"
        )
    own = own_cache(model)
    if own is not None:
        return f"{own}, which transformers' paged cache does not replace"
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - paged_layer_types())
    if unknown:
        return (
            f"{name} has layers of type {', '.join(unknown)}, which transformers' paged cache "
            f"does not hold (ValueError: Invalid layer type: {unknown[0]}; it holds "
            f"{', '.join(sorted(paged_layer_types()))})"
        )
    window = getattr(config, "sliding_window", None)
    if window and not getattr(config, "layer_types", None) and not _applies_window(model):
        return (
            f"transformers' paged cache takes every layer of a config with sliding_window "
            f"({window}) and no layer_types as a sliding-window layer, and {name}'s code applies "
            "no window: the engine would serve another model than the reference"
        )
    if getattr(config, "kv_lora_rank", None):
        return (
            f"{name} uses multi-head latent attention (kv_lora_rank {config.kv_lora_rank}), whose "
            "cache layout transformers' paged cache does not hold (its engine fails with an "
            "index_copy_ shape error)"
        )
    return None


def _applies_window(model: Any) -> bool:
    """Whether the model's modeling code applies a sliding window: builds a sliding mask or
    passes ``sliding_window=`` to its attention as a keyword (Mistral does; Moshi keeps the
    config's ``sliding_window`` as an attribute, ``self.sliding_window = ...``, unused)."""
    import inspect
    import sys

    source = inspect.getsource(sys.modules[type(model).__module__])
    return bool(re.search(r"create_sliding_window_causal_mask|\bsliding_window=(?!=)", source))


def paged_layer_types() -> set[str]:
    """The layer types transformers' paged cache holds (its allocators'), as installed."""
    from transformers.generation.continuous_batching import cache

    return set(cache.ATTN_TYPE_TO_ALLOCATOR)


def paged_divergence(model: Any) -> str | None:
    """A divergence of transformers' paged engine from the reference that numalign has
    measured and reported: None when the engine should agree. A failure is expected only
    where it matches the divergence's signature (``serving.known_divergence``: the errors of
    ``signature_model``, the reference without the feature the engine lacks)."""
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "attn_logit_softcapping", None):
        return (
            "transformers' paged attention kernels (paged|eager, paged|sdpa) do not apply "
            f"attn_logit_softcapping ({config.attn_logit_softcapping}): the engine computes "
            "uncapped attention scores (measured on tiny-gemma2 in float32, whose logits span "
            "tens: relative L2 error 9e-3 at model.layers.0.self_attn's first decode step, "
            "the same as the reference with the softcap removed)"
        )
    return None


def signature_model(golden: GoldenSet, dtype: str, device: torch.device | str) -> Any:
    """The reference in ``dtype`` as the paged engine computes it where ``paged_divergence``
    says it diverges: with the attention soft-capping removed (from the config and from
    every module that copied it), its set's attention implementation, on ``device``."""
    from numalign.golden.reference import load_model

    attn = golden.reference.attn_implementation
    model = load_model(golden.model_dir, dtype, attn_implementation=attn, trust_remote_code=False)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        if getattr(config, "attn_logit_softcapping", None):
            config.attn_logit_softcapping = None
    for module in model.modules():
        if getattr(module, "attn_logit_softcapping", None):
            module.attn_logit_softcapping = None
    return model.to(device)


@dataclass
class _Served:
    """What the engine computed, by (engine request, step): the logits, and per (point, call,
    output path) the new token's output row."""

    logits: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[str, int, str, int, str], torch.Tensor] = field(default_factory=dict)
    #: per forward: (engine request, first row, query length, step it produces, emits a token)
    layout: list[tuple[str, int, int, int, bool]] = field(default_factory=list)
    #: per forward: which recorded call each call of a point is (``replay.layer.CallOrder``)
    orders: dict[str, CallOrder] = field(default_factory=dict)


def replay_paged_requests(
    golden: GoldenSet,
    model: Any,
    device: torch.device | str,
    on_pair: OnPair,
) -> list[str]:
    """Serves every row of every golden decode request (but those ``unservable`` says the
    engine cannot take: image requests, explicit positions) through the paged engine,
    teacher-forced, and hands on each step's point outputs and logits per golden request
    ([batch, ...], like ``run_decode``). Returns the requests served."""
    import torch

    reason = paged_unsupported(model)
    if reason is not None:
        raise PagedUnsupported(reason)
    rows: dict[str, tuple[str, int, list[int], list[int]]] = {}
    served_requests = []
    for request in golden.decode_requests:
        inputs = golden.request(request).inputs
        if unservable(inputs, golden.tensor):
            continue
        decode = golden.decode(request)
        assert decode is not None
        ids = golden.tensor(inputs["input_ids"])
        mask = golden.tensor(inputs["attention_mask"]).bool()
        tokens = torch.cat([golden.tensor(s.token) for s in decode.steps], dim=1)
        for b in range(ids.shape[0]):
            rows[f"{request}#{b}"] = (request, b, ids[b][mask[b]].tolist(), tokens[b].tolist())
        served_requests.append(request)
    if not rows:
        return []
    steps = {r: len(golden.decode(r).steps) for r in served_requests}  # type: ignore[union-attr]
    served = _serve(model, golden, rows, max(steps.values()))
    for request in served_requests:
        decode = golden.decode(request)
        assert decode is not None
        mine = [rid for rid, (req, *_) in rows.items() if req == request]
        for number, step in enumerate(decode.steps, start=1):
            for point, calls in step.points.items():
                for index, outputs in enumerate(calls):
                    for path, key in outputs.items():
                        found = [
                            served.outputs.get((rid, number, point, index, path)) for rid in mine
                        ]
                        missing = [rid for rid, t in zip(mine, found, strict=True) if t is None]
                        if missing:
                            raise PagedServingError(
                                f"the paged engine never ran {point} (call {index}, output {path}) "
                                f"for the new token of {', '.join(missing)} at step {number}"
                            )
                        # [batch, 1, hidden], as the golden step stores it
                        actual = torch.stack(found)[:, None]  # type: ignore[arg-type]
                        on_pair(request, number, point, path, actual, golden.tensor(key),
                                call=index)  # fmt: skip
            logits = torch.stack([served.logits[(rid, number)] for rid in mine])
            on_pair(request, number, OUTPUT_POINT, "logits", logits, golden.tensor(step.logits))
    return served_requests


def _serve(
    model: Any,
    golden: GoldenSet,
    rows: dict[str, tuple[str, int, list[int], list[int]]],
    steps: int,
) -> _Served:
    """Runs the engine on every row, teacher-forced with its golden tokens, and collects."""
    import torch

    served = _Served()
    manager = _manager(model, rows, steps)
    forced = {rid: tokens for rid, (_, _, _, tokens) in rows.items()}

    def before(module: Any, args: Any, kwargs: Any) -> None:
        served.layout, served.orders, start = [], {}, 0
        for future in manager.batch_processor.inputs_and_outputs.requests_in_batch:
            q = int(future.query_length)
            state = future.state
            served.layout.append(
                (state.request_id, start, q, int(state.generated_len()), bool(future.has_new_token))
            )
            start += q

    def after(module: Any, args: Any, kwargs: Any, out: Any) -> Any:
        keep = "logits_to_keep" in kwargs
        emitting = [entry for entry in served.layout if entry[4]]
        forcing = out.logits.clone()
        for k, (rid, _, _, step, _) in enumerate(emitting):
            row = k if keep else int(kwargs["logits_indices"][k])
            if step >= 1:
                served.logits[(rid, step)] = out.logits[0, row].detach().float().cpu()
            if step < len(forced[rid]):
                forcing[0, row] = torch.finfo(forcing.dtype).min
                forcing[0, row, forced[rid][step]] = 0
        out.logits = forcing
        return out

    # every request's calls come in one pattern: the first's tell a forward's calls apart
    first = next(iter(rows.values()))[0]
    steps_of_first = golden.decode(first).steps  # type: ignore[union-attr]
    first_points = steps_of_first[0].points if steps_of_first else {}

    def on_call(point: str, args: Any, kwargs: Any, output: Any) -> None:
        if point not in served.orders:
            prefill = golden.point(point).calls.get(first, [])
            calls = len(first_points.get(point, []))
            served.orders[point] = CallOrder.for_steps(prefill, calls)
        index = served.orders[point].index(args, kwargs)
        if index is None:
            return
        for rid, start, q, step, _ in served.layout:
            if q != 1 or step < 1:  # only decode steps' new tokens
                continue
            for path, tensor in point_tensors(output):
                if path == ROUTING and tensor.dim() == 2:  # a router's: the batch's tokens
                    tensor = tensor[None]
                if isinstance(tensor, torch.Tensor) and tensor.dim() == 3 and tensor.shape[0] == 1:
                    row = tensor[0, start].detach().float().cpu()
                    served.outputs[(rid, step, point, index, path)] = row

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    points = [p.name for p in golden.points]
    try:
        with _quiet() as errors, hooks(model, points, on_call), torch.no_grad():
            prompts = {rid: prompt for rid, (_, _, prompt, _) in rows.items()}
            _run(manager, prompts, steps + 1, errors)
    finally:
        for handle in handles:
            handle.remove()
    return served


def _manager(model: Any, rows: dict[str, tuple[str, int, list[int], list[int]]], steps: int) -> Any:
    """The model's paged engine for ``rows``, not started: greedy, no end-of-sequence token,
    ``steps`` new tokens and one more per row, pages of ``REPLAY_PAGE_SIZE`` tokens for every
    row's prompt and new tokens (four spare; no block shared between rows), ``MAX_BATCH_TOKENS``
    a forward, and the model's own attention (no switch to flash attention)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    pages = sum(-(-(len(p) + steps + 1) // REPLAY_PAGE_SIZE) for _, _, p, _ in rows.values())
    return model.init_continuous_batching(
        generation_config=GenerationConfig(  # type: ignore[no-untyped-call]
            max_new_tokens=steps + 1, do_sample=False, eos_token_id=-1
        ),
        continuous_batching_config=ContinuousBatchingConfig(
            page_size=REPLAY_PAGE_SIZE, num_blocks=pages + 4, max_batch_tokens=MAX_BATCH_TOKENS,
            allow_block_sharing=False, auto_switch_to_flash=False,
        ),
    )  # fmt: skip


#: The engine's error where a model's code uses an API transformers' paged cache lacks (BART's
#: decoder asks ``past_key_values.get_seq_length()``): a path the model cannot take, not a
#: failure of the device.
_MISSING_CACHE_API = re.compile(r"'PagedAttentionCache' object has no attribute '(?P<api>\w+)'")
#: The engine's per-batch arguments the paged cache's ``update`` reads from the keyword
#: arguments the model's attention hands it (transformers 5.24): a KeyError naming one means
#: the model's layers do not forward them from the engine's call (StableLM's decoder layer
#: drops its ``**kwargs``), and an ``update`` called without them at all (GPT-Neo's
#: attention: ``missing 1 required positional argument: 'kwargs'``) the same; its code
#: cannot run paged.
_DROPPED_BATCH_ARGUMENT = re.compile(
    r"^'(?P<name>cu_seq_lens_k|max_length_k|read_index|write_index)'$"
    r"|PagedAttentionCache\.update\(\) missing 1 required positional argument: '(?P<arg>kwargs)'"
)


def _run(
    manager: Any,
    prompts: dict[str, list[int]],
    new_tokens: int,
    errors: list[BaseException] | None = None,
) -> None:
    """Serves ``prompts`` and waits for all of them (PagedServingError on an engine error or
    after ENGINE_TIMEOUT_S; PagedUnsupported where the model's code calls what the paged
    cache lacks, or fails in itself on the engine's inputs: ``errors`` holds the exceptions
    the engine logged); the engine's thread is always stopped."""
    manager.start()
    done: set[str] = set()
    try:
        for rid, prompt in prompts.items():
            manager.add_request(prompt, request_id=rid, max_new_tokens=new_tokens,
                                eos_token_id=-1)  # fmt: skip
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while len(done) < len(prompts):
            if time.monotonic() > deadline:
                raise PagedServingError(
                    f"the paged engine served {len(done)} of {len(prompts)} requests in "
                    f"{ENGINE_TIMEOUT_S:.0f} s; it is stuck or far too slow"
                )
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise PagedServingError("the paged engine's generation loop stopped early")
                continue
            if result.error:
                missing = _MISSING_CACHE_API.search(str(result.error))
                if missing:  # the model's code asks the paged cache for what it lacks
                    raise PagedUnsupported(
                        f"the model's code calls {missing['api']} on transformers' paged "
                        f"cache, which has none ({result.error}): the paged engine cannot "
                        "serve this model"
                    )
                dropped = _DROPPED_BATCH_ARGUMENT.search(str(result.error).strip())
                if dropped:
                    raise PagedUnsupported(
                        "the model's layers do not pass the paged engine's batch arguments on "
                        f"to its cache ({result.error}: a forward that drops its **kwargs): "
                        "the paged engine cannot serve this model"
                    )
                where = _in_model_code(errors or [])
                if where:
                    raise PagedUnsupported(
                        f"transformers' code for this model fails on the paged path, at {where} "
                        f"({result.error}: a mask, cache or attribute it expects from the "
                        "eager path): the paged engine cannot serve this model"
                    )
                raise PagedServingError(
                    f"the paged engine failed request {result.request_id}: {result.error}"
                )
            if result.is_finished():
                done.add(result.request_id)
    finally:
        manager.stop(block=True, timeout=10)
        manager.destroy()


#: Errors of Python code meeting a value it did not expect (a None mask, a missing key, an
#: argument it does not take), as opposed to a kernel's or a device's (RuntimeError).
_CODE_PATH_ERRORS = (AttributeError, KeyError, TypeError)


def _in_model_code(errors: list[BaseException]) -> str | None:
    """Where the last error the engine logged was raised, as ``file:line: code``, when it is
    an error of a code path (``_CODE_PATH_ERRORS``) raised in transformers' code for a model
    (``transformers/models/``: MPT calls ``.to`` on the causal mask the paged path does not
    build) or an attention integration (``transformers/integrations/``: the eager paged
    attention reshapes MiMo-V2's ``sinks``, None on its layers without); None when it was
    raised elsewhere or is of another kind (a kernel or device error: a failure)."""
    import traceback

    if not errors or not isinstance(errors[-1], _CODE_PATH_ERRORS):
        return None
    if errors[-1].__traceback__ is None:
        return None
    frame = traceback.extract_tb(errors[-1].__traceback__)[-1]
    path = frame.filename.replace("\\", "/")
    if not any(f"/transformers/{part}/" in path for part in ("models", "integrations")):
        return None
    return f"{'/'.join(path.split('/')[-2:])}:{frame.lineno}: {(frame.line or '').strip()}"


class _EngineErrors(logging.Handler):
    """Keeps the exceptions the engine logs (its generation loop logs them with exc_info)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.errors.append(record.exc_info[1])


@contextmanager
def _quiet() -> Iterator[list[BaseException]]:
    """The engine's own logger at errors only while it serves (it logs every batch); yields
    the exceptions it logs."""
    engine_log = logging.getLogger("ContinuousBatchingLogger")
    level = engine_log.level
    engine_log.setLevel(logging.ERROR)
    kept = _EngineErrors()
    engine_log.addHandler(kept)
    try:
        yield kept.errors
    finally:
        engine_log.removeHandler(kept)
        engine_log.setLevel(level)
