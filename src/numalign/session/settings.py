"""The session settings shared by the pytest plugin and the CLI, validated without torch: a
frozen :class:`Settings`, built from option values by the option table
(``numalign.session.options``), and the checks across options."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numalign.runtime.serving import DEFAULT_SERVING
from numalign.session.option_values import (
    DEFAULT_CACHE_IMPLEMENTATIONS,
    DEFAULT_DTYPES,
    DEFAULT_ENGINE,
    DEFAULT_REGRESSION_FACTOR,
    DEFAULT_TIER,
    DEFAULT_VLLM_MEMORY,
    TIERS,
)
from numalign.session.options import BY_NAME, OPTIONS

__all__ = [
    "Settings",
    "engine_conflicts",
    "in_shard",
    "pipeline_conflicts",
    "stream_conflicts",
]


@dataclass(frozen=True)
class Settings:
    """What a numalign session runs: where, in which dtypes, how much, against what."""

    device: str = "auto"
    device_plugins: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    tier: str = DEFAULT_TIER
    golden_dirs: tuple[Path, ...] = ()
    #: Replay only the sets of ``golden_dirs``, not the rootdir's golden/sets (``numalign run``).
    golden_only: bool = False
    candidate_modules: tuple[str, ...] = ()
    report_dir: Path = Path("reports")
    baseline: Path | None = None
    regression_factor: float = DEFAULT_REGRESSION_FACTOR
    fail_on_regression: bool = False
    history: Path | None = None
    swaps: tuple[str, ...] = ()
    #: (index, count), 1-based: this machine runs the tests whose stable hash falls in shard
    #: index of count; None: all of them.
    shard: tuple[int, int] | None = None
    attn_implementation: str | None = None
    experts_implementation: str | None = None
    allow_tf32: bool = False
    #: Where the operator suite keeps its float64 truths (``numalign.ops.truths``); None: off.
    #: A session's is the rootdir's unless --truth-cache says otherwise: the plugin resolves
    #: the folder against the rootdir before ``from_options``.
    truth_cache: Path | None = None
    #: Bytes the truth cache is kept under (least recently used entries go first; 0: no cap):
    #: --truth-cache-size's default, 4GB.
    truth_cache_max_bytes: int = 4 * 10**9
    #: Run folders the report folder keeps (older ones are removed); 0: every run.
    keep_runs: int = 10
    #: What decode replay runs with (--cache-implementation).
    cache_implementations: tuple[str, ...] = DEFAULT_CACHE_IMPLEMENTATIONS
    #: ``torch.compile`` backend the suites run candidates and models through (--compile);
    #: None: eager.
    compile_backend: str | None = None
    #: ``torch.compile`` mode (--compile-mode); None: the backend's default.
    compile_mode: str | None = None
    #: Tensor-parallel ranks the model suites replay each model on (--tp); 1: one process.
    tp: int = 1
    #: Seconds one replay may take on the tensor-parallel ranks before a hung rank is
    #: stopped and the test fails (--tp-timeout).
    tp_timeout: float = 600.0
    #: The command that starts the tensor-parallel ranks (--tp-launcher; None: torchrun
    #: --standalone on this machine); numalign appends the rank program and its arguments.
    tp_launcher: str | None = None
    #: Pipeline ranks the model suites replay each model on (--pp), each holding a
    #: contiguous range of its decoder layers; 1: one process. They run on the tensor-parallel
    #: group's launcher and timeout (--tp-launcher, --tp-timeout).
    pp: int = 1
    #: What replays the model suites' models (--engine): one of ENGINES.
    engine: str = DEFAULT_ENGINE
    #: vLLM's memory share for its KV cache (--vllm-memory), in (0, 1).
    vllm_memory: float = DEFAULT_VLLM_MEMORY
    #: How a serving engine serves the golden requests (--serving): arrangements of
    #: ``numalign.runtime.serving``, one model and decode test each.
    serving: tuple[str, ...] = (DEFAULT_SERVING,)
    #: The model suites stream each model's weights from its checkpoint, one unit (a
    #: decoder layer, the embedding, the head) on the device at a time (--stream).
    stream: bool = False

    def tier_rank(self) -> int:
        return TIERS.index(self.tier)

    @classmethod
    def from_options(cls, values: Mapping[str, object]) -> Settings:
        """Validated settings from option values by option name (``numalign.session.options``:
        ``dtype`` for ``--dtype``, ``tp_timeout`` for ``--tp-timeout``), as pytest and the
        CLI read them: strings, lists of strings for repeatable options, booleans for
        switches; ``truth_cache`` is the folder already resolved (``numalign.ops.truths``). Each
        option reads its value into the field it sets (``Option.read``), in the table's
        order; a name absent or None keeps the field's default. The one validation of the
        plugin and the CLI's ``run`` and ``nightly``: ValueError with the message of the bad
        value (the plugin raises it as a usage error, the CLI exits with it)."""
        unknown = sorted(set(values) - set(BY_NAME))
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
        fields = {
            option.setting: option.read(values[option.name])
            for option in OPTIONS
            if values.get(option.name) is not None
        }
        settings = cls(**fields)
        _check_golden(settings)
        if settings.baseline is not None:
            _check_baseline(settings.baseline)
        conflict = (
            engine_conflicts(settings) or stream_conflicts(settings) or pipeline_conflicts(settings)
        )
        if conflict:
            raise ValueError(conflict)
        return settings


def _check_golden(settings: Settings) -> None:
    """``--golden-only`` has sets to replay, and every ``--golden`` folder exists."""
    if settings.golden_only and not settings.golden_dirs:
        raise ValueError(
            "--golden-only replays the --golden sets alone, and none was given: "
            "add --golden SET_FOLDER"
        )
    for folder in settings.golden_dirs:
        if not folder.is_dir():
            raise ValueError(
                f"--golden {folder}: no such folder; pass a golden set folder or a "
                "folder of sets (see numalign capture)"
            )


def _check_baseline(path: Path) -> None:
    """The baseline is a run's records, read now and whole (a torn or empty file would count
    its missing records as new, never as regressions): a wrong path fails before the first
    test, not after the whole run."""
    from numalign.records.drift import read_records

    if not path.exists():
        raise ValueError(f"--drift-baseline {path}: no such run folder or records file")
    try:
        read_records(path, whole=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"--drift-baseline {path}: {exc}; give a run folder under --report-dir "
            "(reports/<run-id>/) or its records.jsonl"
        ) from None


def _given(options: list[tuple[str, Any]]) -> list[str]:
    """The names among ``(name, value)`` pairs whose value the session set."""
    return [name for name, value in options if value]


def engine_conflicts(settings: Settings) -> str | None:
    """Why the session's options do not fit its engine (None when they do): the kernel swaps,
    attention and experts implementations and tensor parallel are transformers' variants;
    vLLM picks its own kernels and attention backend (recorded in every record), and its CPU
    build serves tensor parallel only through its multiprocess executor, which numalign's
    in-process hooks cannot reach."""
    if settings.engine == "transformers":
        if settings.serving != (DEFAULT_SERVING,):
            return (
                f"--serving {','.join(settings.serving)}: serving arrangements are a serving "
                "engine's (prefix cache, chunked prefill, preemption); replay with --engine "
                "vllm, or drop --serving"
            )
        return None
    given = _given([
        ("--swap", settings.swaps), ("--attn-implementation", settings.attn_implementation),
        ("--experts-implementation", settings.experts_implementation),
        ("--tp", settings.tp > 1), ("--pp", settings.pp > 1),
    ])  # fmt: skip
    if not given:
        return None
    return (
        f"--engine {settings.engine} replays the engine's own kernels; {', '.join(given)} "
        "choose transformers' variants: drop them, or replay with --engine transformers"
    )


def stream_conflicts(settings: Settings) -> str | None:
    """Why ``--stream`` does not fit the session's other options (None when it does or is
    off): vLLM loads its own weights. A kernel swap streams (``replay.swap.Swapped``); a
    compiled streamed model compiles each unit alone (``runtime.compiled_model``); under
    ``--tp`` each unit loads the rank's shard (``golden.stream``)."""
    if not settings.stream:
        return None
    given = _given([(f"--engine {settings.engine}", settings.engine != "transformers")])
    if not given:
        return None
    return (
        f"--stream is not supported together with {', '.join(given)}: streamed replay runs "
        "transformers' eager model one unit of weights at a time; drop --stream, or drop "
        f"{', '.join(given)}"
    )


def pipeline_conflicts(settings: Settings) -> str | None:
    """Why ``--pp`` does not fit the session's other options (None when it does or is off):
    a pipeline rank holds whole layers of transformers' eager model, loaded as a streamed one
    (``replay.pipeline``); sharding those layers too (``--tp``) is not built. A kernel swap
    runs on each rank's layers (``replay.swap.Swapped``); compiled, each rank compiles its own
    units alone (``runtime.compiled_model``)."""
    if settings.pp <= 1:
        return None
    given = _given([("--tp", settings.tp > 1)])
    if not given:
        return None
    return (
        f"--pp is not supported together with {', '.join(given)} yet: pipeline-parallel "
        f"replay runs transformers' eager model, each rank its own layers whole; drop --pp, "
        f"or drop {', '.join(given)}"
    )


def in_shard(test_id: str, shard: tuple[int, int] | None) -> bool:
    """Whether a test belongs to this shard: a stable hash of its id, so every machine
    agrees and a test stays in its shard as others come and go."""
    if shard is None:
        return True
    import hashlib

    digest = int.from_bytes(hashlib.sha256(test_id.encode()).digest()[:8], "little")
    return digest % shard[1] == shard[0] - 1
