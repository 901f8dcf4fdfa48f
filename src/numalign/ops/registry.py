"""Operator specs and candidates, with external registration.

An operator (``operators/<family>.py``) declares its reference, case grid, outputs and the
Hugging Face modules it stands for. A candidate is an implementation under test, registered
with ``@numalign.candidate("rms_norm", name="fused")``; built-in ones sit beside their
operator, a vendor's come from ``--candidates MODULE`` or the ``numalign.candidates``
entry-point group.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, TypeVar

from numalign.compare import OP_CLASSES, Budget

# the rounding judge's data, at home in compare.rounding: catalogue modules import it from here
from numalign.compare.rounding import DEFAULT_LAYOUT, ROUND_TO_NEAREST, CodeLayout, RoundingRule
from numalign.core.errors import UsageError
from numalign.core.names import did_you_mean
from numalign.ops.cases import Case

#: The built-in catalogue: one module per operator family.
CATALOGUE: tuple[str, ...] = (
    "operators.linear",
    "operators.norms",
    "operators.activations",
    "operators.rotary",
    "operators.attention",
    "operators.paged_kv",
    "operators.moe",
    "operators.scan",
    "operators.selection",
    "operators.block_sparse",
    "operators.linear_attention",
    "operators.vision",
    "operators.quantization",
    "operators.logits",
    "operators.sampling",
    "operators.rope_scaling",
    "operators.mla",
    "operators.sinks",
    "operators.fp8_block",
    "operators.int4",
    "operators.kv_quant",
)
ENTRY_POINT_GROUP = "numalign.candidates"

T = TypeVar("T")


class RegistryError(UsageError, LookupError):
    """An unknown name, or a name registered twice."""


class Registry(Mapping[str, T]):
    """A small name -> entry registry with clash checks and "did you mean" errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T, *, replace: bool = False) -> T:
        if name in self._entries and not replace and self._entries[name] is not entry:
            raise RegistryError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            hint = did_you_mean(name, self._entries)
            known = ", ".join(sorted(self._entries)) or "none"
            raise RegistryError(f"Unknown {self.kind} {name!r}.{hint} Known: {known}.") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class Output:
    """One output of an operator.

    ``kind`` is "float" (compared against the control's error budget), "exact" (integers,
    indices), "ties" (indices that may differ among tied scores; ``ties_from`` names the
    input or output holding the scores, along the last dimension) or "quantized" (a
    quantizer's codes, judged by ``rounding`` on their round trip: ``quantized_from`` names
    the input they quantize, ``scale_from`` the output holding their scale, and ``layout``
    the codes' format and the blocks that share a scale: a ``CodeLayout``, or a function of
    the case returning one where they depend on it). ``atol`` lets exact outputs differ by
    that much.

    ``undecided(inputs, case)``, for float outputs, returns a boolean mask (the output's
    shape) of the positions whose value rounding alone decides between two honest results
    (a token at the top-p boundary kept or cut, as the cumulative sum's rounding falls): the
    truth, the control and the candidate are compared with those positions set to zero, and
    the result says how many there were."""

    name: str
    kind: str = "float"
    ties_from: str | None = None
    atol: float = 0.0
    undecided: Callable[[Mapping[str, Any], Case], Any] | None = None
    quantized_from: str | None = None
    scale_from: str | None = None
    rounding: RoundingRule = ROUND_TO_NEAREST
    layout: CodeLayout | Callable[[Case], CodeLayout] = DEFAULT_LAYOUT

    def __post_init__(self) -> None:
        if self.kind not in ("float", "exact", "ties", "quantized"):
            raise ValueError(f"output {self.name}: kind must be float, exact, ties or quantized")
        if self.undecided is not None and self.kind != "float":
            raise ValueError(f"output {self.name}: only float outputs have undecided positions")
        if self.kind == "ties" and not self.ties_from:
            raise ValueError(f"output {self.name}: ties outputs name their scores (ties_from)")
        if self.kind == "quantized" and not (self.quantized_from and self.scale_from):
            raise ValueError(
                f"output {self.name}: quantized outputs name their input (quantized_from) and "
                "their scale (scale_from)"
            )

    def layout_for(self, case: Case | None) -> CodeLayout:
        """The codes' layout on ``case`` (needed only where the layout depends on it)."""
        if isinstance(self.layout, CodeLayout):
            return self.layout
        if case is None:
            raise ValueError(f"output {self.name}: its layout depends on the case; pass one")
        return self.layout(case)


@dataclass(frozen=True)
class Operator:
    """An operator of the catalogue.

    ``reference(**inputs)`` is dtype-generic and upcasts its reductions to at least float32:
    run on float64 inputs it is the truth, on inputs in the target dtype the honest control.
    ``make_inputs(case, generator)`` returns the float64 (and integer) inputs of a case;
    floating inputs are cast to the target dtype for the control and the candidates.
    ``hf_modules`` are fnmatch patterns over Hugging Face module class names the operator
    stands for; ``adapter(module)`` returns the operator's non-activation arguments read from
    such a module (weights, epsilon, ...), so model suites can swap candidates in.
    """

    name: str
    op_class: str
    reference: Callable[..., Any]
    make_inputs: Callable[[Case, Any], dict[str, Any]]
    cases: Sequence[Case]
    outputs: tuple[Output, ...] = (Output("out"),)
    reduction_length: Callable[[Case], int] | None = None
    #: For an operator that exponentiates (a softmax), the farthest an exponent's argument
    #: lies below its row's maximum, in natural units, over a case's inputs (``inputs`` as
    #: the candidate gets them): a kernel that folds a constant rounded to its accumulator
    #: into the exponent (exp2 with log2(e), the softmax scale) leans every weight of a row
    #: by that distance times the constant's rounding (``CompareSpec.exponent_reach``)
    exponent_reach: Callable[[dict[str, Any]], float] | None = None
    hf_modules: tuple[str, ...] = ()
    adapter: Callable[[Any], dict[str, Any]] | None = None
    description: str = ""
    #: Control multipliers where honest alternatives round differently by design (with the
    #: reason beside the number); None: the built-in Budget().
    budget: Budget | None = None
    #: Functions of transformers' modeling modules the operator stands for (rotary is applied
    #: by a function, not a module), and ``function_adapter(candidate_fn, original)``, which
    #: builds a drop-in for such a function from a candidate.
    hf_functions: tuple[str, ...] = ()
    function_adapter: (
        Callable[[Callable[..., Any], Callable[..., Any]], Callable[..., Any]] | None
    ) = None
    #: aten operators (overload packet names, with a variant's keyword where it picks this
    #: operator: ``gelu(approximate=tanh)``) a traced forward runs where the model uses this
    #: operator outside the modules it maps to; ``numalign inventory`` lists them
    aten: tuple[str, ...] = ()
    #: Whether a module it stands for takes one activation of its weight's last dimension, so
    #: that a swap can check the adapter by running the module on a probe input first
    probe_swap: bool = False
    #: Where only some modules of an ``hf_modules`` type are this operator: whether a module
    #: is (a depthwise causal Conv1d is ``causal_conv1d``, any other Conv1d is not)
    hf_module_check: Callable[[Any], bool] | None = field(default=None, compare=False)
    #: Where a model runs this operator's ``aten`` operators only when its config asks for
    #: it: whether the config does (``tanh`` is Gemma 2's final-logit soft-capping only where
    #: ``final_logit_softcapping`` is set; BERT's pooler runs it too)
    hf_config_check: Callable[[Any], bool] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.op_class not in OP_CLASSES:
            raise ValueError(f"operator {self.name}: unknown class {self.op_class!r}")

    def cases_for(self, tier: str) -> list[Case]:
        return [case for case in self.cases if case.runs_at(tier)]

    def stands_for(self, module_type: str) -> bool:
        return any(fnmatch.fnmatchcase(module_type, p) for p in self.hf_modules)

    def extended_by(self, module_type: str) -> bool:
        """Whether ``module_type`` is a form of what this operator stands for that it does
        not take: a pattern's stem inside a longer name (``*RMSNorm`` in
        ``Qwen3NextRMSNormGated``, a norm that multiplies by silu(gate) too)."""
        stems = [p.strip("*") for p in self.hf_modules if p.strip("*")]
        return not self.stands_for(module_type) and any(s in module_type for s in stems)

    def stands_for_module(self, module: Any) -> bool:
        """Whether this operator stands for ``module``: its type, and ``hf_module_check``."""
        if not self.stands_for(type(module).__name__):
            return False
        return self.hf_module_check is None or bool(self.hf_module_check(module))


@dataclass(frozen=True)
class Candidate:
    """An implementation under test of an operator."""

    operator: str
    name: str
    fn: Callable[..., Any]
    devices: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    module: str = ""
    supports: Callable[[Case], str | None] | None = field(default=None, compare=False)

    def skip_reason(self, device_type: str, dtype: str, case: Case) -> str | None:
        """Why this candidate cannot run here, or None when it can."""
        if self.devices is not None and device_type not in self.devices:
            return f"candidate {self.operator}/{self.name} does not run on {device_type}"
        if self.dtypes is not None and dtype not in self.dtypes:
            return f"candidate {self.operator}/{self.name} does not support {dtype}"
        if self.supports is not None:
            return self.supports(case)
        return None


OPERATORS: Registry[Operator] = Registry("operator")
_CANDIDATES: dict[str, Registry[Candidate]] = {}
#: "unloaded", "loading" (catalogue modules register themselves) or "loaded".
_state = "unloaded"


def register_operator(operator: Operator) -> Operator:
    """Adds an operator to the catalogue (clash-checked)."""
    OPERATORS.add(operator.name, operator)
    _CANDIDATES.setdefault(operator.name, Registry(f"candidate of {operator.name}"))
    return operator


def candidate(
    operator: str,
    *,
    name: str,
    devices: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    supports: Callable[[Case], str | None] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the decorated function as a candidate implementation of ``operator``.

    It is called with the operator's inputs as keyword arguments, in the target dtype on the
    target device, and returns what the reference returns. ``devices`` and ``dtypes`` limit
    where it runs (others are skipped with the reason); ``supports(case)`` returns a reason
    to skip a case it does not handle, or None.
    """

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        load_catalogue()
        registry = _CANDIDATES.get(operator)
        if registry is None:
            OPERATORS[operator]  # raises "Unknown operator ... Did you mean"
            raise AssertionError("unreachable")
        registry.add(
            name,
            Candidate(
                operator=operator,
                name=name,
                fn=fn,
                devices=tuple(devices) if devices is not None else None,
                dtypes=tuple(dtypes) if dtypes is not None else None,
                module=fn.__module__,
                supports=supports,
            ),
        )
        return fn

    return register


def candidates(operator: str) -> Registry[Candidate]:
    """The candidates of an operator (raises with "did you mean" for unknown names)."""
    load_catalogue()
    OPERATORS[operator]
    return _CANDIDATES[operator]


def load_catalogue() -> None:
    """Imports the built-in operator families and the entry-point candidates, once: the whole
    catalogue, or a RegistryError naming the module that failed (what that module registered
    is taken back, and the next call tries again)."""
    global _state
    if _state != "unloaded":  # loaded, or loading (a catalogue module's own decorators)
        return
    _state = "loading"
    try:
        for module in CATALOGUE:
            _load_whole(module, functools.partial(importlib.import_module, module))
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            _load_whole(f"entry point {ep.name} ({ep.value})", ep.load)
    except BaseException:
        _state = "unloaded"
        raise
    _state = "loaded"


def _load_whole(what: str, load: Callable[[], object]) -> None:
    """Runs ``load``; when it raises, removes the operators and candidates it registered
    and raises a RegistryError that names ``what``."""
    operators = set(OPERATORS)
    candidates_before = {op: set(registry) for op, registry in _CANDIDATES.items()}
    try:
        load()
    except Exception as exc:
        for name in set(OPERATORS) - operators:
            del OPERATORS._entries[name]
            _CANDIDATES.pop(name, None)
        for op, names in candidates_before.items():
            for name in set(_CANDIDATES[op]) - names:
                del _CANDIDATES[op]._entries[name]
        raise RegistryError(
            f"the operator catalogue did not load: {what} raised {type(exc).__name__}: {exc}. "
            "Fix or uninstall it; nothing it registered is kept, and the catalogue loads again "
            "on the next use"
        ) from exc


def load_candidate_modules(modules: Sequence[str]) -> None:
    """Imports modules that register external candidates (``--candidates``)."""
    load_catalogue()
    for module in modules:
        importlib.import_module(module)
