"""Kernel swap: every module an operator stands for, its forward replaced in a loaded model by
a candidate called through the operator's adapter (``--swap rms_norm=fused``)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from numalign.compare.tolerances import SWAP_PROBE_EPS
from numalign.core.errors import UsageError
from numalign.ops.registry import OPERATORS, Candidate, Operator, candidates, load_catalogue


class SwapError(UsageError, ValueError):
    """A swap that cannot be applied; the message says why and what to do."""


#: The attribute a swapped module carries: its ``Swapped``.
SWAPPED = "_numalign_swapped"


class Swapped:
    """A module's forward replaced in place by a candidate called through the operator's
    adapter, which reads the module's own arguments (weights, epsilon, ...) at every call.
    The module, its type, its parameters and their names stay as they were, so a streamed
    or pipeline-parallel model, which loads each module's parameters by name when it runs,
    loads a swapped module's as any other's. Whether the adapter reads the module and
    reproduces its own forward on a probe input (``settle``) is decided on its weights: as
    it is swapped where they are there, else at its first call (a streamed model's weights
    are on the meta device until then)."""

    def __init__(self, module: torch.nn.Module, name: str, operator: Operator,
                 candidate: Candidate) -> None:  # fmt: skip
        self.module, self.name = module, name
        self.operator, self.candidate = operator, candidate
        self.original = module.forward  # the bound class forward, or an earlier override
        self.input_name = next(iter(inspect.signature(operator.reference).parameters))
        #: whether the candidate stands for the module (None: not settled yet)
        self.usable: bool | None = None

    def __repr__(self) -> str:
        return f"{self.operator.name}={self.candidate.name}"

    def settle(self) -> bool:
        """Whether the candidate stands for the module, decided once on its weights: a
        module the adapter cannot read (a norm without a scale) keeps its own forward, as
        ``apply_swaps`` leaves one whose weights it could look at; an adapter that does not
        reproduce the module is a SwapError (again at every call until it does). The
        adapters' probes run the module's class forward, never this one."""
        if self.usable is None:
            usable = adapts(self.operator, self.module)
            if usable:
                _check_adapter(self.name, self.module, self.operator, self.original)
            else:
                self.module.forward = self.original
            self.usable = usable
        return self.usable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # a pipeline stage runs another rank's modules on the meta device, for shapes only:
        # their own forward, never settled on weights that are not there
        if _on_meta(self.module) or not self.settle():
            return self.original(*args, **kwargs)
        x = args[0] if args else next(iter(kwargs.values()))
        assert self.operator.adapter is not None
        return self.candidate.fn(**{self.input_name: x}, **self.operator.adapter(self.module))


def swapped_as(module: torch.nn.Module) -> Swapped | None:
    """The swap ``apply_swaps`` made of ``module`` (None where it keeps its own forward)."""
    found = module.__dict__.get(SWAPPED)
    return found if isinstance(found, Swapped) else None


def settle_within(root: torch.nn.Module) -> None:
    """Settles every swap in ``root`` whose weights are there: what a compiled unit of a
    streamed model runs eager before its graph (``runtime.compiled_model``), so that no probe runs
    while Dynamo traces."""
    for module in root.modules():
        swapped = swapped_as(module)
        if swapped is not None and swapped.usable is None and not _on_meta(module):
            swapped.settle()


def _on_meta(module: torch.nn.Module) -> bool:
    """Whether ``module``'s weights are not loaded yet (a streamed or pipeline stage's)."""
    return any(p.device.type == "meta" for p in module.parameters())


def _swap(module: torch.nn.Module, name: str, operator: Operator, candidate: Candidate) -> None:
    swapped = Swapped(module, name, operator, candidate)
    module.__dict__[SWAPPED] = swapped
    module.forward = swapped
    if not _on_meta(module):  # decided at once, as the model loads
        swapped.settle()


class SwapUnmatched(SwapError):
    """A swap that matches no module of one model: that model's replays skip with the reason
    (a swap that matches no module of any replayed model is a usage error, ``unmatched``)."""


def lacking_forms(op: Operator, types: set[str]) -> list[str]:
    """Module types that are forms of what ``op`` stands for which it does not take: a
    pattern's stem inside a longer name (``*RMSNorm`` -> ``Qwen3NextRMSNormGated``, a gated
    norm that multiplies by silu(gate) too)."""
    return sorted(t for t in types if op.extended_by(t))


def unmatched_message(op: Operator, cand_name: str, types: set[str]) -> str:
    """Why ``--swap op=cand_name`` matches no module among ``types``, and what the model has."""
    lacking = lacking_forms(op, types)
    text = (
        f"--swap {op.name}={cand_name}: no module of this model is one that {op.name} stands "
        f"for ({', '.join(op.hf_modules)})"
    )
    if lacking:
        return text + (
            f"; it has {', '.join(lacking)}, a form of it that {op.name} lacks (a gated or "
            "otherwise extended module: an operator of that form is needed to swap it)"
        )
    return text + f"; its module types: {', '.join(sorted(types)[:20])}"


def unmatched(swaps: Sequence[tuple[str, str]], types: set[str]) -> list[str]:
    """The swaps (OPERATOR=CANDIDATE pairs, ``parse_swaps``) that match no module type in
    ``types`` (the module types of every model a session replays): each a message. ``all=``
    and function swaps (rotary: a function, not a module type) are not judged here."""
    load_catalogue()
    out = []
    for op_name, cand_name in swaps:
        op = OPERATORS.get(op_name)
        if op is None or op.adapter is None:
            continue
        if not any(op.stands_for(t) for t in types):
            out.append(unmatched_message(op, cand_name, types).replace("this model", "any model"))
    return out


def unmatched_in_sets(set_paths: Iterable[str], swaps: Sequence[tuple[str, str]]) -> list[str]:
    """``unmatched`` over the models of the golden sets at ``set_paths`` (their module types,
    ``module_types``): the swaps that match no module of any of them, each a message. Never
    raises: a set that cannot be read, or a model that cannot be built on the meta device
    (whatever it raises), leaves nothing judged here ([]), and the tests that replay it load it
    and fail or skip with their own message."""
    from numalign.golden import GoldenSet

    types: set[str] = set()
    for path in sorted(set_paths):
        try:
            types |= module_types(GoldenSet.open(path).model_dir)
        except Exception:  # the set's own tests say what is wrong with it
            return []
    return unmatched(swaps, types)


def meta_model(model_dir: str | Path, *, device: str = "meta") -> torch.nn.Module:
    """The model in ``model_dir`` built from its config (no weights read) on ``device`` (the
    meta device by default: nothing allocated; ``cpu`` for a tiny model whose modules must
    run, with initial weights), as the class its config names (``architectures``:
    MllamaForCausalLM saves a text config no Auto class maps), else as a causal LM."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device(device):
        if cls is None:
            return transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call,no-any-return]
        return cls._from_config(config)  # type: ignore[no-any-return]


def module_types(model_dir: str | Path) -> set[str]:
    """The module types of the model in ``model_dir`` (``meta_model``)."""
    return {type(m).__name__ for m in meta_model(model_dir).modules()}


def parse_swaps(specs: Sequence[str]) -> list[tuple[str, str]]:
    """``["rms_norm=fused", "all=torch"]`` -> pairs; SwapError on a malformed or unknown one,
    or one whose operator has no adapter from a module (or function) to its arguments, which
    no model can take (the plugin makes it a usage error before any test runs)."""
    load_catalogue()
    pairs = []
    for spec in specs:
        op, sep, name = spec.partition("=")
        if not sep or not op or not name:
            raise SwapError(f"--swap {spec!r}: write OPERATOR=CANDIDATE, e.g. rms_norm=fused")
        if op != "all":
            candidates(op)[name]  # "Unknown operator/candidate ... Did you mean"
            if OPERATORS[op].adapter is None and OPERATORS[op].function_adapter is None:
                raise SwapError(_no_adapter(op, name))
        pairs.append((op, name))
    return pairs


def _no_adapter(op_name: str, cand_name: str) -> str:
    swappable = sorted(o.name for o in OPERATORS.values() if o.adapter or o.function_adapter)
    return (
        f"--swap {op_name}={cand_name}: operator {op_name} has no adapter from a Hugging Face "
        f"module to its arguments, so it cannot be swapped into a model (swappable: "
        f"{', '.join(swappable)}); test its candidates with the operator suite "
        f"(suites/operators -k {op_name})"
    )


def apply_swaps(model: torch.nn.Module, swaps: Sequence[tuple[str, str]]) -> list[str]:
    """Replaces the mapped modules; returns their names. ``all=NAME`` swaps every operator
    with an adapter that has a candidate NAME."""
    load_catalogue()
    swapped: list[str] = []
    for op_name, cand_name in swaps:
        ops = (
            [
                op
                for op in OPERATORS.values()
                if (op.adapter or op.function_adapter) and cand_name in candidates(op.name)
            ]
            if op_name == "all"
            else [OPERATORS[op_name]]
        )
        for op in ops:
            if op.adapter is None and op.function_adapter is not None:
                names = _swap_function(model, op, candidates(op.name)[cand_name])
                if not names and op_name != "all":
                    raise SwapError(
                        f"--swap {op.name}={cand_name}: no module of this model calls "
                        f"{', '.join(op.hf_functions)}; {op.name} cannot be swapped into it"
                    )
                swapped += names
                continue
            if op.adapter is None:
                raise SwapError(_no_adapter(op.name, cand_name))
            names = [n for n, m in model.named_modules() if n and op.stands_for_module(m)]
            if not names and op_name != "all":
                types = {type(m).__name__ for m in model.modules()}
                raise SwapUnmatched(unmatched_message(op, cand_name, types))
            cand = candidates(op.name)[cand_name]
            # a module whose weights are not loaded yet is settled at its first call
            readable = [
                n for n in names
                if _on_meta(model.get_submodule(n)) or adapts(op, model.get_submodule(n))
            ]  # fmt: skip
            if not readable and op_name != "all":
                raise SwapUnmatched(
                    f"--swap {op.name}={cand_name}: the adapter of {op.name} reads none of the "
                    f"modules it stands for ({', '.join(names[:4])}: a form without the "
                    "parameters it takes, such as a norm without a scale)"
                )
            for name in readable:
                _swap(model.get_submodule(name), name, op, cand)
                swapped.append(name)
    return swapped


def adapts(op: Operator, module: torch.nn.Module) -> bool:
    """Whether the operator's adapter reads ``module``'s arguments: a module of the type
    without the parameters it takes (Gemma 4's RMSNorm without a scale, ``with_scale=False``)
    keeps its own forward."""
    assert op.adapter is not None
    try:
        op.adapter(module)
    except AttributeError:
        return False
    return True


def _swap_function(model: torch.nn.Module, op: Operator, cand: Candidate) -> list[str]:
    """Rotary and the like are functions of the modeling module, called from attention
    modules: each such module gets the candidate's drop-in for the duration of its forward
    (a pre-hook installs it, a hook that always runs restores the original), so other models
    in the process keep the original."""
    assert op.function_adapter is not None
    patched = []
    for name, module in model.named_modules():
        source_module = sys.modules.get(type(module).__module__)
        if source_module is None or not type(module).__name__.endswith("Attention"):
            continue
        for function in op.hf_functions:
            original = getattr(source_module, function, None)
            if original is None or function not in inspect.getsource(type(module).forward):
                continue
            replacement = op.function_adapter(cand.fn, original)

            def install(
                *_: Any, where: Any = source_module, f: str = function, r: Any = replacement
            ) -> None:
                setattr(where, f, r)

            def restore(
                *_: Any, where: Any = source_module, f: str = function, o: Any = original
            ) -> None:
                setattr(where, f, o)

            module.register_forward_pre_hook(install)
            module.register_forward_hook(restore, always_call=True)
            patched.append(name)
    return patched


def _check_adapter(
    name: str, module: torch.nn.Module, op: Operator, forward: Callable[..., Any]
) -> None:
    """The operator's reference, through the adapter, must reproduce the module's own
    ``forward`` on a probe input: otherwise the swap would test the wrong thing."""
    weight = next((p for p in module.parameters()), None)
    if weight is None or not op.probe_swap:
        return
    probe = torch.randn(3, weight.shape[-1], generator=torch.Generator().manual_seed(0))
    probe = probe.to(weight.device, weight.dtype)
    assert op.adapter is not None
    with torch.no_grad():
        mine = op.reference(probe.float(), **op.adapter(module)).float()
        theirs = forward(probe).float()
    # the module rounds to its dtype a few times more than the float32 reference
    tol = SWAP_PROBE_EPS * torch.finfo(weight.dtype).eps
    if not torch.allclose(mine, theirs, rtol=tol, atol=tol):
        raise SwapError(
            f"--swap {op.name}: the adapter does not reproduce {name} ({type(module).__name__}); "
            f"max difference {float((mine - theirs).abs().max()):.3g}: teach the adapter of "
            f"{op.name} this module type"
        )
