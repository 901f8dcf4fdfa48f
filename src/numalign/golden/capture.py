"""Capturing a golden set from a local Hugging Face model folder: capture only records.

Forward pre-hooks (with kwargs) and forward hooks on the capture points record each point's
inputs and outputs while the reference forward runs; tensors go to safetensors shards of
bounded size as they arrive (``store.ShardWriter``), so peak memory stays near the model plus
one shard. A tensor two points share (one layer's output is the next one's input) is stored
once. Requests that generate also run a cached decode (``Decode``): the prefill with a
dynamic KV cache, then ``decode_steps`` steps of one token each, recording each step's
token, logits and the new token's outputs at every capture point, and the cache's contents
after the prefill and after the last step. The set is written into a temporary folder and
renamed into place; ``finish`` runs on the finished temporary set first
(``replay.calibrate.capture_calibrated`` calibrates there), so a set is never seen
half-written.
"""

from __future__ import annotations

import fnmatch
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.errors import BrokenData
from numalign.golden.decode import DEFAULT_DECODE_STEPS, record_decode
from numalign.golden.fingerprint import BackgroundFingerprint
from numalign.golden.folders import clear_temporary, remove_abandoned, temporary_folder
from numalign.golden.loading import load_reference, stream_choice
from numalign.golden.long_bound import check_long_request
from numalign.golden.manifest import (
    LOGIT_TRANSFORM,
    Call,
    Continuation,
    KeyTree,
    Manifest,
    ModelInfo,
    Point,
    ReferenceInfo,
    Request,
)
from numalign.golden.probes import record_probes
from numalign.golden.progress import Progress, progress_mode
from numalign.golden.reference import (
    Placement,
    append_token,
    flatten,
    forward_kwargs,
    greedy_step,
    hooks,
    jsonable,
    model_outputs,
    takes_cache,
)
from numalign.golden.requests import (
    DEFAULT_PROMPTS,
    FAR_LENGTH,
    CaptureRequest,
    far_request,
    image_request,
    long_length,
    long_requests,
    text_requests,
)
from numalign.golden.routing import point_tensors
from numalign.golden.store import (
    DEFAULT_SHARD_BYTES,
    GoldenSet,
    GoldenSetError,
    ShardWriter,
    replace_set,
    write_manifest,
)
from numalign.golden.target import check_target, keep_version

if TYPE_CHECKING:
    import torch

DEFAULT_CONTINUATION = 8
#: Module class names that are capture points inside a block.
_BLOCK_PARTS = re.compile(
    r"(Attention|Attn|MLP|Mlp|MoE|Moe|MoeBlock|Experts|GatedDeltaNet|Norm|LayerNorm"
    r"|Intermediate|Output)$"  # an encoder layer's feed-forward halves (BERT)
)
_SKIP_TYPES = re.compile(r"(RotaryEmbedding|Dropout|Activation|ModuleList|ModuleDict|Identity)$")
#: The model's position-embedding modules (rotary cos/sin computed once per forward and fed
#: to every attention): capture points outside the blocks, so a fault in what the attention is
#: fed is judged where it is made.
_POSITION_TYPES = re.compile(r"RotaryEmbedding$")
#: An MoE block's router (transformers 5's ``...TopKRouter``, remote code's ``MoEGate``):
#: a capture point inside the block, so that what it chooses and weighs is judged where it
#: is computed (``golden.routing``).
_ROUTER_TYPES = re.compile(r"(Router|MoEGate)$")


# -- what to capture --------------------------------------------------------------------------
def default_points(model: torch.nn.Module) -> list[str]:
    """Embeddings, the masks (``golden.mask_points``) and position embeddings (rotary
    cos/sin) the model computes outside its blocks, every block (decoder or vision) with its
    attention, MLP or MoE (and the MoE's router, ``golden.routing``) and norms, the final
    norm, the LM head and the logit transform after it (``golden.logit_transform``, where
    the model has one), and the vision patch embedding and merger."""
    import torch

    from numalign.golden.logit_transform import LogitTransform
    from numalign.golden.mask_points import MaskFunction

    blocks = {
        name
        for name, module in model.named_modules()
        if name.rpartition(".")[2].isdigit()
        and isinstance(model.get_submodule(name.rpartition(".")[0]), torch.nn.ModuleList)
        and not _SKIP_TYPES.search(type(module).__name__)
    }

    def in_block(name: str) -> bool:
        return any(name.startswith(b + ".") for b in blocks)

    def wanted(name: str, module: torch.nn.Module) -> bool:
        kind = type(module).__name__
        if isinstance(module, MaskFunction):  # a mask the model builds, where it calls one
            return True
        if isinstance(module, LogitTransform):  # after the head, where the model does something
            return module.changes_logits()
        if name and _POSITION_TYPES.search(kind):
            return not in_block(name) and ".visual" not in name
        if not name or _SKIP_TYPES.search(kind):
            return False
        if name in blocks or name == "lm_head" or name.endswith((".merger", ".patch_embed")):
            return True
        if name.rpartition(".")[0] in blocks:  # a block's attention, MLP, MoE or norm
            return bool(_BLOCK_PARTS.search(kind))
        if _ROUTER_TYPES.search(kind):  # an MoE block's router
            return in_block(name)
        if isinstance(module, torch.nn.Embedding):
            return not in_block(name)
        # the final norm: outside every block and outside the vision tower
        return (
            kind.endswith("Norm")
            and not in_block(name)
            and ".visual" not in name
            and "merger" not in name
        )

    return [name for name, module in model.named_modules() if wanted(name, module)]


def select_points(model: torch.nn.Module, patterns: Sequence[str] | None) -> list[str]:
    """The default points, or the modules whose names match any of ``patterns`` (fnmatch)."""
    if not patterns:
        return default_points(model)
    names = [
        n
        for n, _ in model.named_modules()
        if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)
    ]
    if not names:
        raise ValueError(
            f"--points {list(patterns)} match no module; module names look like "
            f"{[n for n, _ in model.named_modules() if n][:6]}"
        )
    return names


# -- recording ----------------------------------------------------------------------------------
@dataclass
class _Recorder:
    """Turns each call of a capture point into a ``Call`` whose tensors are in the writer."""

    writer: ShardWriter
    calls: dict[str, dict[str, list[Call]]] = field(default_factory=dict)
    #: the first call whose outputs are not all finite: (request, point, output path,
    #: non-finite count, element count)
    nonfinite: tuple[str, str, str, int, int] | None = None
    #: the current request's attention mask ([batch, sequence]): padded positions may hold
    #: NaN (a query row with every key masked) and are never compared
    mask: Any = None
    #: the points that are masks the model builds (``golden.mask_points``): their outputs are
    #: stored as where each position may attend, whatever form the attention takes them in
    mask_points: frozenset[str] = frozenset()

    def on_call(
        self, request: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        import torch

        put = self.writer.put
        calls = self.calls.setdefault(name, {}).setdefault(request, [])
        base = f"{request}/{name}/{len(calls)}"
        kw_keys: dict[str, KeyTree] = {}
        kw_json: dict[str, Any] = {}
        for k, v in kwargs.items():

            def put_kwarg(path: str, t: Any, k: str = k) -> str:
                return put(f"{base}/kwargs/{k}/{path}", t)

            keys = key_tree(v, put_kwarg)
            if keys is not None:
                kw_keys[k] = keys
            else:
                kw_json[k] = jsonable(v)
        arg_keys = tuple(_positional_keys(a, f"{base}/args/{i}", put) for i, a in enumerate(args))
        arg_json = tuple(
            None if k is not None else jsonable(a) for a, k in zip(args, arg_keys, strict=True)
        )
        if name in self.mask_points and isinstance(output, torch.Tensor):
            from numalign.compare.exact import attends

            output = attends(output)
        tensors = point_tensors(output)  # a router's as its logits and routing
        outputs = {p: put(f"{base}/out/{p}", t) for p, t in tensors}
        # the point's main output (hidden states; not attention weights, whose padded query
        # rows are NaN where every key is masked), at the positions the mask keeps
        first = tensors[0] if tensors else None
        if self.nonfinite is None and first is not None:
            bad = _nonfinite(first[1], self.mask)
            if bad:
                self.nonfinite = (request, name, first[0], bad, first[1].numel())
        calls.append(Call(arg_keys, arg_json, kw_keys, kw_json, outputs))


def key_tree(value: Any, put: Callable[[str, Any], str]) -> KeyTree | None:
    """An input's tensors (keyword or positional) stored through ``put(path, tensor)``, in
    the input's own shape (``manifest.KeyTree``): a tensor's key, tuples and lists as lists,
    dicts (Zaya's masks by kind, DeepSeek-V4's rotary tables by layer type) as dicts, None
    kept; None where the value holds no tensor or anything else besides (a cache, an
    object), which the manifest keeps as JSON instead."""
    import torch

    leaves = list(flatten(value))
    if not any(isinstance(t, torch.Tensor) for _, t in leaves) or not all(
        t is None or isinstance(t, torch.Tensor) for _, t in leaves
    ):
        return None

    def tree(v: Any, path: str) -> KeyTree:
        if v is None:
            return None
        if isinstance(v, torch.Tensor):
            return put(path or "0", v)
        if isinstance(v, dict) or (hasattr(v, "to_tuple") and hasattr(v, "keys")):
            return {str(k): tree(v[k], f"{path}.{k}" if path else str(k)) for k in v}
        return [tree(x, f"{path}.{i}" if path else str(i)) for i, x in enumerate(v)]

    return tree(value, "")


def _positional_keys(value: Any, key: str, put: Callable[[str, Any], str]) -> KeyTree | None:
    """A positional input's tensors in its own shape (``key_tree``), as keyword inputs are
    (Qwen4-Exp's attention takes its rotary tables as a positional tuple, which was kept as
    JSON, an object, and fed back as None): a plain tensor under ``key``, as sets always
    had it, the tensors of a tuple, list or dict under ``key/PATH``."""
    import torch

    if isinstance(value, torch.Tensor):
        return put(key, value)
    return key_tree(value, lambda path, t: put(f"{key}/{path}", t))


def capture(
    model_dir: str | Path,
    out: str | Path,
    *,
    points: Sequence[str] | None = None,
    prompts: Sequence[str] | None = None,
    image: str | None = None,
    reference_dtype: str = "float32",
    continuation: int = DEFAULT_CONTINUATION,
    decode_steps: int = DEFAULT_DECODE_STEPS,
    long: int | None = None,
    far: int = FAR_LENGTH,
    max_position: int | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    placement: Placement | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool | None = None,
    finish: Callable[[GoldenSet, Callable[[str], None]], None] | None = None,
    finish_steps: int = 0,
    force: bool = False,
    probes: bool = True,
    stream: bool | None = None,
) -> GoldenSet:
    """Captures a golden set of the model in ``model_dir`` into ``out`` (replaced atomically:
    an interrupted capture leaves any previous set untouched and no partial folder).
    ``finish(golden, step)`` runs on the whole set in its temporary folder before it is moved
    into place; ``step(text)`` advances the progress bar (``finish_steps`` steps are its).

    ``long``: the length of the long requests (None: past every length boundary of the
    model, ``requests.long_length``; 0: none; past the model's positions or the memory:
    refused before the model loads, ``long_bound.check_long``). Encoders get no long requests
    and no decode. ``far``: tokens per row of the far-position request (0: none), its rows a
    quarter, half and all the way into ``max_position`` (None: the config's), as
    ``requests.far_request`` says. ``probes``: record each point's probe calls (False: none).

    ``out`` must not exist, be empty or hold a set of this model (``folders.check_target``);
    ``force`` replaces a set of another model, kept under ``<sets>/.versions/``.

    For a model whose weights do not fit in memory, ``placement`` (``reference.Placement``:
    accelerate's device map and disk offload) or ``stream`` (unit by unit from the
    checkpoint, ``golden.stream``; None: ``resolve_stream`` chooses) give the same set."""
    model_dir, out = Path(model_dir).resolve(), Path(out)
    check_target(out, model_dir, force=force)  # first: never load a model to then refuse
    _check_counts(continuation=continuation, decode_steps=decode_steps, image=image,
                  reference_dtype=reference_dtype)  # fmt: skip
    # eager attention by default: the reference implementation, whose explicit 4D masks every
    # other attention implementation accepts when a point is replayed alone
    attn_implementation = attn_implementation or "eager"
    hashing, streamed, model = _checked_reference(
        model_dir, long, max(continuation, decode_steps), reference_dtype,
        attn_implementation, trust_remote_code, placement, stream,
    )  # fmt: skip
    decoder = takes_cache(model)
    requests = _requests(model_dir, model, prompts=prompts, image=image, decoder=decoder,
                         long=long, far=far, max_position=max_position,
                         trust_remote_code=trust_remote_code)  # fmt: skip
    point_names = select_points(model, points)

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out.parent)
    tmp = temporary_folder(out)
    bar = Progress(progress_mode(progress), len(requests) + finish_steps, out.name)
    try:
        manifest = _manifest(model, model_dir, out, reference_dtype)
        _record_all(model, requests, point_names, manifest, ShardWriter(tmp, max_shard_bytes),
                    bar, continuation=continuation,
                    decode_steps=decode_steps if decoder else 0, probes=probes,
                    activations=not points)  # fmt: skip
        digest, files = hashing.result()
        manifest.model = replace(manifest.model, fingerprint=digest, files=files)
        if streamed:
            print(f"numalign capture: {hashing.throughput()}", file=sys.stderr, flush=True)
        write_manifest(tmp, manifest)
        del model
        if finish is not None:
            finish(GoldenSet.open(tmp), bar.step)
        _place(tmp, out, model_dir, force=force)
    except BaseException:
        hashing.cancel()
        bar.close()
        clear_temporary(tmp)
        raise
    bar.close(done=True)
    return GoldenSet.open(out)


def _checked_reference(
    model_dir: Path,
    long: int | None,
    generated: int,
    reference_dtype: str,
    attn_implementation: str,
    trust_remote_code: bool,
    placement: Placement | None,
    stream: bool | None,
) -> tuple[BackgroundFingerprint, bool, Any]:
    """The model folder's fingerprint and its files' being hashed on a thread of their own
    (``BackgroundFingerprint``: the hashing reads beside the capture's reads), whether the
    reference streams (``resolve_stream``), and the reference loaded whole, placed or
    streamed, seeded. The checks that need no model come first: a folder without
    config.json, or a sharded checkpoint missing a shard its index names, is an error naming
    the file before anything loads; so is a --long too long (``long_bound``)."""
    import torch

    hashing = BackgroundFingerprint(model_dir)
    try:
        check_long_request(model_dir, long, generated, reference_dtype, attn_implementation,
                           trust_remote_code, in_memory=placement is None)  # fmt: skip
        streamed = resolve_stream(model_dir, reference_dtype, stream, placement)
        torch.manual_seed(0)
        model = load_reference(model_dir, reference_dtype,
                               attn_implementation=attn_implementation,
                               trust_remote_code=trust_remote_code, placement=placement,
                               stream=streamed)  # fmt: skip
    except BaseException:
        hashing.cancel()
        raise
    return hashing, streamed, model


def resolve_stream(
    model_dir: str | Path, reference_dtype: str, stream: bool | None, placement: Placement | None
) -> bool:
    """Whether the capture streams its reference: as asked, or (``stream`` None) the
    automatic choice (``loading.stream_choice``), which prints why where it streams."""
    chosen, why = stream_choice(model_dir, reference_dtype, stream, placement=placement)
    if why:
        print(why, file=sys.stderr, flush=True)
    return chosen


def _requests(
    model_dir: Path,
    model: Any,
    *,
    prompts: Sequence[str] | None,
    image: str | None,
    decoder: bool,
    long: int | None,
    far: int,
    max_position: int | None,
    trust_remote_code: bool,
) -> list[CaptureRequest]:
    """Every request of a capture, in order: the prompts, the long requests (``long`` None:
    past every length boundary of a decoder), the far-position request and the image request,
    each where the model and the options have one; ValueError naming the option on bad
    sizes."""
    requests = text_requests(model_dir, model.config, prompts or DEFAULT_PROMPTS,
                             trust_remote_code)  # fmt: skip
    if long is None:
        long = long_length(model.config) if decoder else 0
    if long < 0:
        raise ValueError(f"--long {long}: a length in tokens, or 0 for no long requests")
    if long:
        requests += long_requests(model_dir, model.config, long, trust_remote_code)
    if far < 0 or (max_position is not None and max_position < 1):
        raise ValueError(
            f"--far {far} / --max-position {max_position}: tokens per far row (0 for none) and "
            "a position range of at least 1"
        )
    far_positions = far_request(model_dir, model.config, far, trust_remote_code, max_position)
    requests += [far_positions] if far_positions is not None else []
    extra = image_request(model_dir, model.config, image)
    requests += [extra] if extra is not None else []
    return requests


def _record_all(
    model: Any,
    requests: Sequence[CaptureRequest],
    point_names: list[str],
    manifest: Manifest,
    writer: ShardWriter,
    bar: Progress,
    *,
    continuation: int,
    decode_steps: int,
    probes: bool = True,
    activations: bool = True,
) -> None:
    """Runs every request through the model with the points hooked, writing their tensors
    through ``writer`` and filling ``manifest`` (tensors, shards, decode steps of the requests
    that generate, and the points in forward order with their calls); then, with ``probes``,
    each probe of a point (``golden.probes``: a norm on rows at its epsilon, an activation on
    its gating tail, with ``activations`` a point of its own) as a call of the request
    ``probe``."""
    from numalign.golden.mask_points import MaskFunction

    recorder = _Recorder(writer, mask_points=frozenset(
        n for n in point_names if isinstance(model.get_submodule(n), MaskFunction)))  # fmt: skip
    for request in requests:
        bar.step(f"request {request.name}")
        _record_request(model, request, point_names, recorder, manifest, continuation)
        if request.generate and decode_steps > 0:
            manifest.decode[request.name] = record_decode(
                model, request, point_names, writer, decode_steps
            )
    recorder.mask = None
    recorded = {n: recorder.calls[n] for n in point_names if recorder.calls.get(n)}
    probed = record_probes(model, recorded, activations, recorder.on_call) if probes else []
    writer.flush()
    manifest.tensors, manifest.shards = dict(writer.tensors), dict(writer.shards)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    manifest.points = [
        Point(n, type(model.get_submodule(n)).__name__, order[n], recorder.calls[n])
        for n in sorted({*point_names, *probed}, key=lambda n: order[n])
        if recorder.calls.get(n)
    ]


def _place(tmp: Path, out: Path, model_dir: Path, *, force: bool) -> None:
    """Moves the finished set from ``tmp`` into ``out``, keeping a replaced set under
    ``.versions/``; the target is checked again (it may have changed during the capture)."""
    if check_target(out, model_dir, force=force):
        kept = keep_version(out, _stamp(out))
        print(f"numalign capture: kept the replaced set under {kept}", file=sys.stderr)
    replace_set(tmp, out)


def _check_counts(
    *, continuation: int, decode_steps: int, image: str | None, reference_dtype: str
) -> None:
    """Capture's counts are whole numbers of at least 0, its image a file and its reference
    dtype float32 or float64 (ValueError naming the option otherwise), checked before the
    model loads."""
    if reference_dtype not in ("float32", "float64"):
        raise ValueError(f"--reference-dtype {reference_dtype!r}: float32 or float64")
    for option, value in (("--continuation", continuation), ("--decode-steps", decode_steps)):
        if value < 0:
            raise ValueError(f"{option} {value}: a number of tokens, 0 or more (0: none)")
    if image is not None and not Path(image).is_file():
        raise ValueError(f"--image {image}: no such file; give an image file (PNG, JPEG, ...)")


def _stamp(folder: Path) -> str:
    """When the set at ``folder`` was captured (its name under .versions), or ``unreadable``."""
    try:
        return GoldenSet.open(folder).manifest.created or "unknown"
    except GoldenSetError:
        return "unreadable"


def _manifest(
    model: Any,
    model_dir: Path,
    out: Path,
    reference_dtype: str,
) -> Manifest:
    """The manifest of a capture before its requests run: the model (its fingerprint and
    files' sha256 filled in once the background hash is done) and the reference."""
    import torch
    import transformers

    config = model.config
    return Manifest(
        model=ModelInfo(
            path=os.path.relpath(model_dir, out.resolve()),
            name=model_dir.name,
            architecture=type(model).__name__,
            model_type=getattr(config, "model_type", None),
            fingerprint="",
        ),
        reference=ReferenceInfo(
            device="cpu",
            dtype=reference_dtype,
            attn_implementation=getattr(config, "_attn_implementation", None),
            torch=torch.__version__,
            transformers=transformers.__version__,
            seed=0,
        ),
        requests=[],
        points=[],
        tensors={},
        shards={},
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def _record_request(
    model: Any,
    request: CaptureRequest,
    point_names: list[str],
    recorder: _Recorder,
    manifest: Manifest,
    continuation: int,
) -> None:
    """One request's reference forward: every capture point's calls, the model's own outputs
    and, for language models, the greedy continuation; its tensors stream to the writer."""
    import torch

    writer, name = recorder.writer, request.name
    inputs = {k: writer.put(f"{name}/inputs/{k}", v) for k, v in request.inputs.items()}

    def on_call(point: str, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        recorder.on_call(name, point, args, kwargs, output)

    recorder.mask = request.inputs.get("attention_mask")
    transform = LOGIT_TRANSFORM in point_names
    with (
        torch.no_grad(),
        hooks(model, point_names, on_call),
        _head_output(model, transform) as head,
    ):
        finals = model_outputs(model(**request.inputs, **forward_kwargs(model)))
        if head:  # the forward does not call the logit transform: once here, on its input
            model.get_submodule(LOGIT_TRANSFORM)(head[-1])
        head.clear()
    _refuse_nonfinite(recorder, name, finals)
    if "logits" in finals:
        manifest.logits[name] = writer.put(f"{name}/logits", finals["logits"])
    else:
        manifest.outputs[name] = {k: writer.put(f"{name}/output/{k}", t)
                                  for k, t in finals.items()}  # fmt: skip
    del finals
    writer.release()
    if request.generate and continuation > 0 and name in manifest.logits:
        manifest.continuation[name] = _greedy(model, request, continuation, writer)
    manifest.requests.append(Request(name, inputs))


@contextmanager
def _head_output(model: Any, wanted: bool) -> Iterator[list[Any]]:
    """The LM head's outputs while the model runs (the logit transform's input), where the
    logit transform is a point (``wanted``); else nothing is hooked."""
    outputs: list[Any] = []
    if not wanted:
        yield outputs
        return
    head = model.get_submodule(model.get_submodule(LOGIT_TRANSFORM).head)
    handle = head.register_forward_hook(lambda module, args, output: outputs.append(output))
    try:
        yield outputs
    finally:
        handle.remove()


class NonFiniteReferenceError(BrokenData, ValueError):
    """The reference produced NaN or Inf: a set of it would pass any replay vacuously."""


def _nonfinite(t: Any, mask: Any = None) -> int:
    """How many values of a floating tensor are NaN or Inf at the positions ``mask`` keeps
    (a [batch, sequence] attention mask, where ``t`` starts with those dimensions; padded
    positions are never compared); 0 for anything else."""
    import torch

    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return 0
    t = t.detach()
    if isinstance(mask, torch.Tensor) and t.dim() >= 2 and t.shape[:2] == mask.shape:
        t = t[mask.to(t.device).bool()]
    return int((~torch.isfinite(t)).sum())


def _refuse_nonfinite(recorder: _Recorder, request: str, finals: dict[str, Any]) -> None:
    """NonFiniteReferenceError naming the first capture point (in the order the forward ran
    them) whose outputs hold NaN or Inf, or the final output that does: NaN matches NaN, so
    a non-finite golden value would make every replay pass."""
    where = recorder.nonfinite
    if where is None:
        for key, t in finals.items():
            bad = _nonfinite(t, recorder.mask)
            if bad:
                where = (request, f"the model's {key}", "", bad, t.numel())
                break
    if where is None:
        return
    req, point, path, bad, total = where
    output = f" output {path!r}" if path else ""
    raise NonFiniteReferenceError(
        f"the reference is not finite: {point}{output} of request {req} holds {bad} NaN or "
        f"Inf of {total} values, the first capture point where they appear; a golden set of "
        "it would pass any replay (NaN matches NaN). Check the checkpoint's weights for "
        "inf/nan (torch.isfinite), and try another --reference-dtype or --attn-implementation "
        "(eager attention in float64 gives left-padded batches NaN); no set was written"
    )


def _greedy(model: Any, request: CaptureRequest, steps: int, writer: ShardWriter) -> Continuation:
    """``steps`` greedy tokens, re-running the whole sequence each step (no cache), and the
    logits of each step."""
    import torch

    inputs = dict(request.inputs)
    tokens, step_logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            nxt, logits = greedy_step(model, inputs)
            tokens.append(nxt)
            step_logits.append(logits)
            inputs = append_token(inputs, nxt)
    return Continuation(
        tokens=writer.put(f"{request.name}/continuation/tokens", torch.cat(tokens, dim=1)),
        logits=writer.put(f"{request.name}/continuation/logits", torch.stack(step_logits, dim=1)),
    )
