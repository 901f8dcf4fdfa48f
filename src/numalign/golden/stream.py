"""Streaming a model's weights (``--stream``): a model whose weights do not fit in memory
(the capture's reference) or on the device (a replay), run with only the weights of the
module running held.

:func:`load_streamed` builds the model's skeleton with every parameter on the meta device
(its buffers real: a rotary embedding's ``inv_freq`` is computed in ``__init__``), in the
target dtype, with the attention and experts implementations asked for, exactly as
``golden.reference.load_model`` builds it. The model is cut into **streaming units**: each
child of a ``nn.ModuleList`` (a decoder layer, a vision block) and every other module that
holds parameters of its own outside those (the embedding, the final norm, the LM head). A
forward pre-hook on a unit and on every module inside it reads that unit's tensors alone
from the checkpoint's safetensors (by tensor name, across the shards of
``model.safetensors.index.json``), converts them with transformers' own loading machinery
(its key renamings and weight converters: fused MoE experts, renamed prefixes) and the
model's dtype plan (modules kept in float32), and puts them on the device; the forward hook
puts them back on meta once the outermost call of the unit returns. A layer replay (one
point fed its golden inputs) loads the one unit holding the point; a capture, a full-model
or decode replay loads each unit as the forward reaches it, so each forward reads the
checkpoint once.

Peak memory on the device: one unit's weights (two where a tied weight is shared by two
units running at once, which no forward does) plus the activations and the KV cache. The
numbers are the unstreamed model's: the same tensors, converted by the same code, cast the
same way. Nothing downstream changes: a streamed capture writes the unstreamed capture's
set, and the replays, the verdicts and the records are the ones of an unstreamed model (the
records name the variant ``stream``).

It lives below both the capture (``golden``, which never imports ``replay``) and the
replays (the model cache under ``--stream``); ``golden.loading`` chooses between a whole
reference and a streamed one for the capture.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.compare.model_verdict import ReplayUnsupported
from numalign.golden.model_folder import ModelFolderError, check_model_dir
from numalign.golden.reference import attach_points, implementations, model_class
from numalign.golden.stream_experts import find_routed, stream_by_expert

if TYPE_CHECKING:
    import torch

#: The index of a sharded safetensors checkpoint (``{"weight_map": {tensor: file}}``).
SHARD_INDEX = "model.safetensors.index.json"
#: The one file of an unsharded checkpoint.
SINGLE_FILE = "model.safetensors"


class StreamUnsupported(ReplayUnsupported):
    """A model that cannot be streamed unit by unit (no safetensors, a weight converter
    whose outputs land in two units): the replay is skipped with the reason."""


class StreamError(ModelFolderError):
    """The checkpoint does not hold what the model needs (a tensor missing, a shard the
    index names absent): what is missing, where, and how to restore it."""


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers goes to the meta device; buffers stay where they
    are computed (accelerate's ``init_empty_weights(include_buffers=False)``, written here
    so that no accelerate is needed)."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = dict(module._parameters[name].__dict__)
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the shard index or the one file
    (only its header is read); StreamUnsupported for a checkpoint without safetensors,
    StreamError for a shard the index names that is absent."""
    from safetensors import safe_open

    index = model_dir / SHARD_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
        files = {name: model_dir / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise StreamError(
                    f"{index} names the shard {file.name}, which is not in {model_dir}: "
                    "restore the checkpoint's files from the model's repository"
                )
        return files
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise StreamUnsupported(
            f"--stream reads a model's tensors one unit at a time from safetensors, and "
            f"{model_dir} has neither {SINGLE_FILE} nor {SHARD_INDEX}: convert the "
            "checkpoint where you trust it (model.save_pretrained(DIR, "
            "safe_serialization=True)), or capture or replay without --stream"
        )
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


@dataclass
class Streamer:
    """The streaming state of one model: its units, which checkpoint tensors each parameter
    comes from, which are on the device now, and what was read (for the tests and the
    benchmark: ``reads``, how many times each checkpoint tensor was read, and
    ``peak_bytes``, the largest total of parameter bytes on the device at once)."""

    model: Any
    device: torch.device
    dtype: torch.dtype
    files: dict[str, Path]
    #: parameter name (its owner's, for a tied one) -> the checkpoint tensors it is made of
    sources: dict[str, tuple[str, ...]]
    #: unit name -> the parameter names (owners' names) it needs
    units: dict[str, tuple[str, ...]]
    #: tied parameter -> the parameter it is (``model.all_tied_weights_keys``)
    tied: dict[str, str]
    load_config: Any
    depth: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    holders: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    reads: Counter[str] = field(default_factory=Counter)
    loaded_bytes: int = 0
    peak_bytes: int = 0

    def enter(self, unit: str) -> None:
        """Before a call of ``unit`` or of a module in it: its parameters on the device, read
        from the checkpoint unless an outer call of it has them there."""
        self.depth[unit] += 1
        if self.depth[unit] > 1:
            return
        wanted = []
        for name in self.units[unit]:
            self.holders[name] += 1
            if self.holders[name] == 1:
                wanted.append(name)
        if wanted:
            self._load(wanted)

    def exit(self, unit: str) -> None:
        """After a call: the outermost call of ``unit`` puts its parameters back on meta."""
        self.depth[unit] -= 1
        if self.depth[unit] > 0:
            return
        freed = []
        for name in self.units[unit]:
            self.holders[name] -= 1
            if self.holders[name] == 0:
                freed.append(name)
        if freed:
            self._unload(freed)

    def resident(self) -> list[str]:
        """The parameters on the device now (none between forwards)."""
        return [n for n, p in self.model.named_parameters() if p.device.type != "meta"]

    def _load(self, names: list[str]) -> None:
        keys = sorted({key for name in names for key in self.sources[name]})
        self.convert(self.read(keys))
        self._retie(names)
        params = dict(self.model.named_parameters())
        self.hold(sum(_nbytes(params[n]) for n in names))

    def read(self, keys: list[str]) -> dict[str, Any]:
        """The checkpoint tensors ``keys``, each file opened once; StreamError naming a
        tensor its shard lacks."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = defaultdict(list)
        for key in keys:
            by_file[self.files[key]].append(key)
        state: dict[str, Any] = {}
        for file, file_keys in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                present = set(f.keys())
                for key in file_keys:
                    if key not in present:
                        raise StreamError(
                            f"{file}: no tensor {key!r}, which the shard index places there; "
                            "restore the checkpoint's files from the model's repository"
                        )
                    state[key] = f.get_tensor(key)
                    self.reads[key] += 1
        return state

    def convert(self, state: dict[str, Any]) -> None:
        """Checkpoint tensors into the model's parameters, by transformers' own conversion
        (renamings, converters, the dtype plan); StreamError where they do not fit."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.utils import logging as hf_logging

        # transformers draws a progress bar per load: one a unit a forward here, thousands
        # in a capture of a deep model
        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        try:
            info, _ = convert_and_load_state_dict_in_model(self.model, state, self.load_config)
        finally:
            if shown:
                hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
        wrong = sorted(str(m[0]) for m in info.mismatched_keys)
        errors = dict(info.conversion_errors)
        if wrong or errors:
            raise StreamError(
                f"{self.model.name_or_path}: the checkpoint's tensors do not fit the model's "
                f"parameters ({', '.join(wrong) or errors}); the folder's config.json and "
                "weights belong to different models"
            )

    def check_loaded(self, names: list[str], what: str) -> None:
        """StreamError where a parameter ``names`` lists is still on meta after a load: the
        checkpoint's tensors ``what`` did not convert into it."""
        meta = [n for n in names if self.model.get_parameter(n).device.type == "meta"]
        if meta:
            raise StreamError(
                f"{self.model.name_or_path}: {what} did not convert into {', '.join(meta)}; "
                "the folder's config.json and weights belong to different models"
            )

    def hold(self, nbytes: int) -> None:
        """``nbytes`` more parameter bytes on the device (fewer where negative)."""
        self.loaded_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.loaded_bytes)

    def _unload(self, names: list[str]) -> None:
        import torch

        for name in names:
            module_name, _, attr = name.rpartition(".")
            module = self.model.get_submodule(module_name)
            param = module._parameters[attr]
            self.hold(-_nbytes(param))
            module._parameters[attr] = torch.nn.Parameter(
                torch.empty_like(param, device="meta"), requires_grad=False
            )
        self._retie(names)

    def _retie(self, names: list[str]) -> None:
        """Tied parameters are their owner's current tensor again (a load or an unload
        replaced the owner's)."""
        changed = set(names)
        for target, owner in self.tied.items():
            if owner in changed:
                module_name, _, attr = target.rpartition(".")
                setattr(
                    self.model.get_submodule(module_name), attr, self.model.get_parameter(owner)
                )


def load_streamed(
    model_dir: str | Path,
    dtype: str,
    device: torch.device | str,
    *,
    attn_implementation: str | None = None,
    experts_implementation: str | None = None,
    trust_remote_code: bool = False,
    tensor_parallel: bool = False,
) -> Any:
    """The model of ``model_dir`` in ``dtype`` for inference on ``device``, streamed: every
    parameter on meta but while a module of its unit runs (module doc); its buffers on the
    device. ``tensor_parallel``: on a rank of a tensor-parallel group (``--tp``), the
    skeleton takes transformers' tensor-parallel plan first (:func:`_distribute`), so each
    unit reads and holds this rank's shard. ``model.numalign_streamer`` is its
    :class:`Streamer`. StreamUnsupported (a
    ReplayUnsupported) for a checkpoint that cannot be streamed, StreamError naming what the
    checkpoint lacks; ValueError from transformers for an implementation the model lacks,
    as ``load_model`` raises it."""
    import torch
    import transformers
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.initialization import no_init_weights
    from transformers.modeling_utils import LoadStateDictConfig

    from numalign.core.dtypes import torch_dtype

    folder = check_model_dir(model_dir)
    files = checkpoint_files(folder)
    target = torch.device(device)
    dt = torch_dtype(dtype)
    config, cls = model_class(folder, trust_remote_code)
    kwargs: dict[str, Any] = {"dtype": dt, **implementations(attn_implementation,
                                                            experts_implementation)}  # fmt: skip
    with _parameters_on_meta(), no_init_weights():
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            model = cls._from_config(config, **kwargs)  # type: ignore[no-untyped-call]
        else:  # an auto class
            model = cls.from_config(config, trust_remote_code=trust_remote_code, **kwargs)
    model.config.name_or_path = str(folder)
    model.eval()
    model, mesh = _distribute(model) if tensor_parallel else (model, None)
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = buffer.to(target)
    load_config = LoadStateDictConfig(
        pretrained_model_name_or_path=str(folder),
        device_map={"": target},
        dtype=dt,
        dtype_plan=model._get_dtype_plan(dt),
        weight_mapping=get_model_conversion_mapping(model),  # type: ignore[arg-type]
        device_mesh=mesh,
    )
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    sources = _sources(model, files, load_config, tied)
    # sharded experts load with their layer (the plan decides which rank holds which)
    routed = {} if tensor_parallel else find_routed(model, sources)
    by_expert = {p for experts in routed.values() for p in experts.params}
    units = {
        unit: tuple(p for p in params if p not in by_expert)
        for unit, params in units_of(model, tied).items()
    }
    streamer = Streamer(model, target, dt, files, sources, units, tied, load_config)
    _load_buffers(streamer)
    _hook(streamer)
    for experts in routed.values():
        stream_by_expert(streamer, experts)
    model.numalign_streamer = streamer
    _report_device(model, target)
    attach_points(model)
    return model


def _distribute(model: Any) -> tuple[Any, Any]:
    """The skeleton with transformers' tensor-parallel plan applied over every rank of
    this process's group (``WORLD_SIZE``), as ``from_pretrained(tp_plan="auto")`` applies it
    before it loads; and the device mesh each unit's load then shards over (transformers'
    loader keeps this rank's shard of each tensor, a DTensor)."""
    from transformers.distributed.configuration_utils import DistributedConfig

    cls = type(model)
    config, _, mesh = cls.prepare_distribute_model(DistributedConfig(tp_plan="auto"))
    model = cls.maybe_distribute_model(model, config, mesh)
    return model, model._device_mesh


def _nbytes(param: Any) -> int:
    """The bytes ``param`` holds on this device: a DTensor's local shard."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return int(local.numel() * local.element_size())


def _sources(
    model: Any, files: dict[str, Path], load_config: Any, tied: dict[str, str]
) -> dict[str, tuple[str, ...]]:
    """Parameter (and persistent buffer) name -> the checkpoint tensors it is made of, by
    transformers' own renaming of checkpoint keys (``rename_source_key``, as
    ``from_pretrained`` renames them); StreamError naming a parameter the checkpoint lacks."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    mapping = load_config.weight_mapping or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = model.state_dict()
    prefix = model.base_model_prefix
    found: dict[str, list[str]] = defaultdict(list)
    for key in files:
        name, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if name not in meta and key in meta:  # as from_pretrained: the key needed no renaming
            name, pattern = rename_source_key(key, [], [], prefix, meta)
        if name not in meta:
            continue  # a tensor the model does not take (from_pretrained ignores it too)
        targets = [name]
        if pattern is not None:  # a converter: its other outputs come from the same tensors
            converter = by_pattern[pattern]
            first = converter.target_patterns[0]
            targets += [name.replace(first, t) for t in converter.target_patterns[1:]]
        for target in targets:
            found[target].append(key)
    params = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in tied]
    missing = sorted(n for n in params if n not in found)
    if missing:
        some = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise StreamError(
            f"{model.name_or_path}: the checkpoint holds no tensor for {some}; restore the "
            "checkpoint's files from the model's repository (an unstreamed load would give "
            "these parameters random values)"
        )
    return {name: tuple(keys) for name, keys in found.items()}


def units_of(model: Any, tied: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """Unit name -> the parameters it needs (a tied one as its owner): each child of a
    ``ModuleList`` that holds parameters, and each other module with parameters of its
    own outside those, its whole subtree included."""
    import torch

    units: dict[str, tuple[str, ...]] = {}

    def visit(name: str, module: torch.nn.Module, in_list: bool) -> None:
        direct = any(p is not None for p in module._parameters.values())
        holds = next(module.parameters(), None) is not None
        if holds and (in_list or direct):
            units[name] = tuple(
                dict.fromkeys(
                    tied.get(_join(name, n), _join(name, n))
                    for n, _ in module.named_parameters(remove_duplicate=False)
                )
            )
            return
        for child_name, child in module.named_children():
            visit(_join(name, child_name), child, isinstance(module, torch.nn.ModuleList))

    visit("", model, False)
    return units


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _load_buffers(streamer: Streamer) -> None:
    """The persistent buffers the checkpoint holds (DeepSeek-V3's router bias), read once
    and kept on the device: they are small, and no unit owns them alone."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model

    buffers = {n for n, _ in streamer.model.named_buffers()}
    keys = sorted({k for n, ks in streamer.sources.items() if n in buffers for k in ks})
    if not keys:
        return
    from safetensors import safe_open

    state = {}
    for key in keys:
        with safe_open(str(streamer.files[key]), framework="pt") as f:
            state[key] = f.get_tensor(key)
    convert_and_load_state_dict_in_model(streamer.model, state, streamer.load_config)


def _report_device(model: Any, device: torch.device) -> None:
    """``model.device`` is ``device``, not its parameters' meta: what runs the model
    places its own tensors there (the paged engine's cache and batches). The model's class
    becomes a subclass of its own, named and placed as it is, that says so."""
    base = type(model)
    namespace = {
        "device": property(lambda self: device),
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
    }
    model.__class__ = type(base.__name__, (base,), namespace)


def _hook(streamer: Streamer) -> None:
    """A pre-hook and an always-called forward hook on each unit and every module in it;
    they do nothing while Dynamo traces a compiled unit (``runtime.compiled_model``: its own
    hooks, eager around the compiled forward, hold its weights)."""
    from torch.compiler import is_compiling

    for unit in streamer.units:
        root = streamer.model.get_submodule(unit)
        for module in root.modules():

            def enter(*_: Any, unit: str = unit) -> None:
                if not is_compiling():
                    streamer.enter(unit)

            def leave(*_: Any, unit: str = unit) -> None:
                if not is_compiling():
                    streamer.exit(unit)

            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave, always_call=True)
