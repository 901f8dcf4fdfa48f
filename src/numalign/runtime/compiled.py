"""Compiled backends: operators, modules and whole models run through ``torch.compile``.

Vendors deliver Day-0 support as graph compilers behind ``torch.compile``; a compiled model
fuses and reorders computations, so its numerics differ from eager. ``--compile [BACKEND]``
(and ``--compile-mode``) makes the suites run what the backend compiled, judged against the
same budgets as eager:

- the operator suite compiles each candidate (:func:`compiled_function`);
- layer replay runs each capture point's module compiled on its own
  (``CompiledModel.get_submodule``);
- full-model replay runs the whole model compiled (``runtime.compiled_model``), with every
  capture point observed from inside the compiled graph.

Decisions:

- **Observed, not broken up.** Eager replay observes the capture points with hooks that read
  golden tensors; run under a compiler, such hooks would break the graph at every point (and
  hooks installed per request would recompile the model every time). A compiled model gets one
  set of *tap* hooks, installed before it is compiled, that only append ``(point, output)`` to
  a list: Dynamo traces them into the graph (the observed tensors become extra graph outputs,
  their values those of the compiled kernels), and replay compares them after the forward
  (``numalign.replay.observe``), in the order the calls completed, as eager replay does.
- **Compiled once per worker.** Compiled callables are kept per process by (function or model,
  backend, mode); ``ModelCache`` keys its models by the compile variant too, so a model is
  compiled once per (set, device, dtype, variant). Dynamo then reuses the compiled graph for
  every call its guards accept. ``dynamic=None`` (automatic dynamic shapes) recompiles once on
  the first new size and then treats that dimension as symbolic; a model's inputs get their
  batch and sequence dimensions marked with ``torch._dynamo.maybe_mark_dynamic`` before the
  first call, so other requests and every step of the greedy continuation reuse the graph.
- **Never silently eager.** Dynamo falls back to eager when a function recompiles more than
  ``recompile_limit`` times; reaching a limit here is an error instead
  (``fail_on_recompile_limit_hit``), so a record named ``compile=...`` always ran compiled
  code. Limits are per ``torch.compile`` call: :data:`RECOMPILE_LIMIT` for an operator
  candidate and for a whole model (compiled in its own region, ``isolate_recompiles``);
  :data:`SHARED_RECOMPILE_LIMIT` for the capture points' modules, which share their entry
  code (``Module.__call__``, transformers' ``GradientCheckpointingLayer.__call__``) with
  every other compiled point of the worker, so that identical layers reuse one compiled graph
  and the entries there grow with every point, dtype and model the worker replays.
  Compilation errors become :class:`CompileError` (a test failure and an ``error`` record
  with the backend's message); graph breaks are a :class:`GraphBreakWarning` with Dynamo's
  reasons and are counted in the record's ``graph_breaks``.
- **Compile time apart from run time.** Dynamo's compile callbacks (``on_compile_start``
  and ``on_compile_end``, fired around every compilation: tracing plus the backend, nested
  ones once) add up a process-wide compile time; a call's compile time is its growth during
  the call, its run time the rest of its wall time. A test's records all carry the test's
  ``compile_s`` (sum it per test, not per record).
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from numalign.core.errors import Crashed, KnownDivergence

if TYPE_CHECKING:
    from numalign.session.settings import Settings

#: Backend used by ``--compile`` without a value.
DEFAULT_BACKEND = "inductor"
#: ``torch.compile`` modes (``--compile-mode``).
COMPILE_MODES: tuple[str, ...] = (
    "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs",
)  # fmt: skip
#: Recompilations allowed per function before it is an error (Dynamo's default is 8, after
#: which it runs eager silently). An operator candidate meets every case of its grid in three
#: dtypes, strided and contiguous: automatic dynamic shapes leave about one compilation per
#: dtype, layout and specialised Python argument (eps, causal, window), well under 64.
RECOMPILE_LIMIT = 64
#: Compilations allowed on the code a compiled point's module enters through, which every
#: compiled point of a worker shares: one entry per distinct module configuration (class,
#: constants such as its layer index, dtype, static or dynamic sizes). The zoo's layer replay
#: compiles 759 points (253 over three dtypes), up to about 1500 entries on one worker (a
#: static compilation, then a dynamic one); SmolLM2-135M's 153 points about 900. 4096 leaves
#: room for deeper checkpoints and still ends a runaway.
SHARED_RECOMPILE_LIMIT = 4096
#: Seconds this process spent compiling so far, and when the compilation under way started.
_compile_clock: dict[str, float] = {"total": 0.0, "since": 0.0}
#: Graph-break reasons a warning quotes (the record counts them all).
_REASONS_SHOWN = 3


class CompileError(Crashed, RuntimeError):
    """A backend failed to compile what a test runs: the test fails with the backend's
    message (and gets an ``error`` record), the session goes on. ``known``: the upstream
    compiler bug it is (:data:`KNOWN_COMPILER_BUGS`), where it is one; such a test is an
    expected failure, its error record kept. ``spent``: what compiling cost the failed test
    (taken from the compiled artifact's stats, so the next test does not inherit it)."""

    def __init__(
        self, message: str, known: str | None = None, spent: CompileStats | None = None
    ) -> None:
        super().__init__(message)
        self.known = known
        self.spent = spent

    def record_fields(self) -> dict[str, Any]:
        """The compile fields of the failed test's error record."""
        return self.spent.record_fields() if self.spent is not None else {}


class KnownCompileError(CompileError, KnownDivergence):
    """A compile failure that is a known upstream compiler bug (``known``): an expected
    failure while it lasts."""

    defect = "compiler bug"


@dataclass(frozen=True)
class KnownCompilerBug:
    """A compiler bug outside numalign, recognised by the compiler's own error text (never
    by what was compiled, so that it cannot hide a kernel's fault)."""

    pattern: str
    what: str

    def matches(self, text: str) -> bool:
        return re.search(self.pattern, text) is not None


#: Upstream compiler bugs, known by their error text. Each is an expected failure while it lasts;
#: once the compiler is fixed the test passes as any other.
KNOWN_COMPILER_BUGS: tuple[KnownCompilerBug, ...] = (
    KnownCompilerBug(
        # gcc's message on Inductor's generated kernel: the variable is quoted with typographic
        # or plain quotes depending on the locale
        r"CppCompileError[\s\S]*error: [‘'`]tmp\d+[’'`] was not declared in this scope",
        "Inductor's C++ code generation (CPU) uses a temporary outside the scope that declares "
        "it, here in an indirect-indexing bounds check (the class of pytorch/pytorch#181621 and "
        "#193581; met on tiny-qwen3-next's decode with torch 2.13)",
    ),
    KnownCompilerBug(
        # Inductor's own wrapper around the failure of its stride-order check
        r"InductorError: ValueError: Exponent must be non-negative",
        "Inductor's stride-order check under dynamic shapes bounds a power of a symbolic size "
        "with a negative exponent (pytorch/pytorch#188323 and #188423, torch 2.13; met on the "
        "mla candidates in float32 once their sizes went dynamic)",
    ),
)


class GraphBreakWarning(UserWarning):
    """Dynamo split a compiled function or model at code it cannot trace: the pieces between
    breaks are compiled, the break itself runs eager."""


@dataclass(frozen=True)
class CompileSpec:
    """What ``--compile`` asks for: a registered ``torch.compile`` backend and a mode."""

    backend: str = DEFAULT_BACKEND
    mode: str | None = None

    @property
    def label(self) -> str:
        """How records name the variant (in ``swap``): ``compile=inductor``, or with a mode
        ``compile=inductor:max-autotune``."""
        return f"compile={self.backend}" + (f":{self.mode}" if self.mode else "")


@dataclass
class CompileStats:
    """Compile cost seen by one test: seconds spent compiling, graph breaks and their
    reasons (Dynamo's messages)."""

    compile_s: float = 0.0
    graph_breaks: int = 0
    reasons: list[str] = field(default_factory=list)

    def add(self, other: CompileStats) -> None:
        self.compile_s += other.compile_s
        self.graph_breaks += other.graph_breaks
        self.reasons += [r for r in other.reasons if r not in self.reasons]

    def take(self) -> CompileStats:
        """These stats, and reset to zero (what one test spent, for its records)."""
        taken = CompileStats(self.compile_s, self.graph_breaks, list(self.reasons))
        self.compile_s, self.graph_breaks, self.reasons = 0.0, 0, []
        return taken

    def record_fields(self) -> dict[str, Any]:
        """The drift record's fields: ``compile_s`` and ``graph_breaks``."""
        return {"compile_s": round(self.compile_s, 6), "graph_breaks": self.graph_breaks}


def registered_backends() -> list[str]:
    """Every backend name ``torch.compile`` accepts here, after ``--device-plugin`` modules
    registered theirs: the ordinary ones first, then the debug ones (``aot_eager``, ...)."""
    from torch._dynamo import list_backends

    ordinary = list_backends()
    return ordinary + sorted(set(list_backends(exclude_tags=())) - set(ordinary))


def validate_spec(backend: str, mode: str | None) -> CompileSpec:
    """The spec, or ValueError naming the registered backends and the modes."""
    if backend not in registered_backends():
        from torch._dynamo import list_backends

        raise ValueError(
            f"unknown --compile backend {backend!r}; registered: {', '.join(list_backends())} "
            f"(debug: {', '.join(b for b in registered_backends() if b not in list_backends())}). "
            "A vendor's backend registers when its module is imported: pass it with "
            "--device-plugin"
        )
    if mode is not None and mode not in COMPILE_MODES:
        raise ValueError(f"unknown --compile-mode {mode!r}; allowed: {', '.join(COMPILE_MODES)}")
    return CompileSpec(backend, mode)


def compile_spec(settings: Settings) -> CompileSpec | None:
    """The session's compile variant (None: eager), from ``--compile``/``--compile-mode``."""
    if not settings.compile_backend:
        return None
    return CompileSpec(settings.compile_backend, settings.compile_mode)


def configure_dynamo() -> None:
    """Raises the recompile limit and makes reaching it an error (never a silent eager
    fallback), and starts the compile clock; idempotent."""
    import torch._dynamo
    from torch._dynamo import callback

    with warnings.catch_warnings():
        # Inductor's CPU passes import torch.utils.mkldnn, whose torch.jit.script_method
        # decorators warn (DeprecationWarning) at import: torch's own, and an error in a
        # session where warnings are errors; imported here once, quietly
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch.utils.mkldnn

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    # Dynamo's cap over every region of one code object (default 256), which the points'
    # shared entry code and the models' isolated regions add up to
    config.accumulated_recompile_limit = max(
        config.accumulated_recompile_limit, 2 * SHARED_RECOMPILE_LIMIT
    )
    config.fail_on_recompile_limit_hit = True
    if "started" not in _compile_clock:
        _compile_clock["started"] = 1.0
        callback.on_compile_start(_clock_start)
        callback.on_compile_end(_clock_end)


def _clock_start(*_: Any) -> None:
    _compile_clock["since"] = time.perf_counter()


def _clock_end(*_: Any) -> None:
    _compile_clock["total"] += time.perf_counter() - _compile_clock["since"]


def _snapshot() -> tuple[float, dict[str, int]]:
    from torch._dynamo.utils import counters

    return _compile_clock["total"], dict(counters["graph_break"])


def _since(before: tuple[float, dict[str, int]]) -> CompileStats:
    seconds, breaks = _snapshot()
    new = {k: n - before[1].get(k, 0) for k, n in breaks.items() if n > before[1].get(k, 0)}
    return CompileStats(max(0.0, seconds - before[0]), sum(new.values()), list(new))


def _is_compile_failure(exc: BaseException) -> bool:
    """Errors of Dynamo or of a backend, not of the code being compiled (those propagate
    as they are)."""
    from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

    names = {c.__module__ for c in type(exc).__mro__}
    dynamo = (TorchDynamoException, FailOnRecompileLimitHit)
    return isinstance(exc, dynamo) or "torch._inductor.exc" in names


def known_bug(exc: BaseException) -> str | None:
    """What known compiler bug ``exc`` is (:data:`KNOWN_COMPILER_BUGS`), or None."""
    text = f"{type(exc).__name__}: {exc}"
    return next((bug.what for bug in KNOWN_COMPILER_BUGS if bug.matches(text)), None)


def _explain(exc: BaseException) -> str:
    """The backend's message, and for a recompile limit what it means."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    if isinstance(exc, FailOnRecompileLimitHit):
        cause = exc.__cause__
        return (
            "it recompiled on call after call until it reached its recompile limit (a guard "
            "that fails every time: a changing Python value, a new shape each call); it "
            "would otherwise run eager, silently. TORCH_LOGS=recompiles names the guard"
            + (f" ({_first_lines(str(cause), 2)})" if cause else "")
        )
    return f"{type(exc).__name__}: {_first_lines(str(exc))}"


def _first_lines(text: str, lines: int = 12) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][:lines]
    return "\n".join(kept)


#: Modules whose warnings are the compiler's notes (``warnings.filterwarnings`` ``module=``).
_COMPILER_MODULES = r"torch\._(dynamo|inductor)(\.|$)"


def run_compiled(
    compiled: Callable[..., Any], spec: CompileSpec, what: str, stats: CompileStats,
    *args: Any, **kwargs: Any,
) -> Any:  # fmt: skip
    """Calls ``compiled``, adding its compile time and graph breaks to ``stats``. A failure
    of Dynamo or the backend raises CompileError naming ``what`` and the backend's message;
    a graph break warns (GraphBreakWarning) with Dynamo's reasons."""
    __tracebackhide__ = True
    before = _snapshot()
    try:
        with warnings.catch_warnings():
            # The compiler's own notes, warned from Dynamo's or Inductor's modules, are shown,
            # not turned into a compilation failure where warnings are errors ("Dynamo
            # detected a call to a functools.lru_cache-wrapped function", "Torchinductor does
            # not support code generation for complex operators": it runs them eager)
            warnings.filterwarnings("default", category=UserWarning, module=_COMPILER_MODULES)
            out = compiled(*args, **kwargs)
    except Exception as exc:
        if not _is_compile_failure(exc):
            raise
        stats.add(_since(before))
        known = known_bug(exc)
        raise (KnownCompileError if known else CompileError)(
            f"{what} failed to compile with torch.compile backend {spec.backend!r}"
            f"{f' (mode {spec.mode})' if spec.mode else ''}: {_explain(exc)}"
            "\nHint: run it eager (without --compile) to tell the "
            "backend's fault from the code's; TORCH_LOGS=graph_breaks,recompiles shows what "
            "Dynamo traced",
            known=known,
            spent=stats.take(),
        ) from None
    seen = _since(before)
    stats.add(seen)
    if seen.graph_breaks:
        shown = "; ".join(_first_lines(r, 2) for r in seen.reasons[:_REASONS_SHOWN])
        warnings.warn(
            GraphBreakWarning(
                f"{what}: {seen.graph_breaks} graph break(s) under {spec.label} (those parts "
                f"run eager): {shown}"
            ),
            stacklevel=2,
        )
    return out


# -- operators: compiled functions ----------------------------------------------------------


@dataclass
class CompiledFunction:
    """A function compiled with one spec, kept per worker; ``stats`` accumulate until a test
    takes them."""

    fn: Callable[..., Any]
    spec: CompileSpec
    compiled: Callable[..., Any]
    name: str
    stats: CompileStats = field(default_factory=CompileStats)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        return run_compiled(self.compiled, self.spec, self.name, self.stats, *args, **kwargs)


_functions: dict[tuple[Callable[..., Any], CompileSpec], CompiledFunction] = {}


def compiled_function(fn: Callable[..., Any], spec: CompileSpec, name: str) -> CompiledFunction:
    """``fn`` compiled with ``spec`` (``dynamic=None``: sizes that change become symbolic
    after one recompilation), created once per worker and reused by every test of it."""
    key = (fn, spec)
    if key not in _functions:
        import torch

        configure_dynamo()
        # torch 2.13 takes recompile_limit and isolate_recompiles; its typed overloads of
        # torch.compile do not list them yet (here and below)
        compiled = torch.compile(  # type: ignore[call-overload]
            fn, backend=spec.backend, mode=spec.mode, dynamic=None,
            recompile_limit=RECOMPILE_LIMIT,
        )  # fmt: skip
        _functions[key] = CompiledFunction(fn, spec, compiled, name)
    return _functions[key]
