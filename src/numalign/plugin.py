"""The numalign pytest plugin: options, ini keys, markers, fixtures. Thin by design: every
behaviour lives in the library; torch is imported only by fixtures that need it."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from numalign.settings import (
    ATTN_IMPLEMENTATIONS,
    CACHE_IMPLEMENTATIONS,
    DEFAULT_CACHE_IMPLEMENTATIONS,
    DEFAULT_DTYPES,
    DEFAULT_TIER,
    DEFAULT_VLLM_MEMORY,
    TIERS,
    Settings,
    engine_conflicts,
    in_shard,
    parse_attn_implementation,
    parse_cache_implementations,
    parse_count,
    parse_dtypes,
    parse_engine,
    parse_experts_implementation,
    parse_seconds,
    parse_shard,
    parse_share,
    parse_size,
    parse_tier,
    parse_tp,
    validate_device,
)
from numalign.truths import (
    TruthCache,
    resolve_truth_folder,
    restore_truth_cache,
    use_truth_cache,
)

if TYPE_CHECKING:
    import torch

    from numalign.compare import TolerancePolicy
    from numalign.record import NodeRecorder

settings_key = pytest.StashKey[Settings]()
previous_truth_cache_key = pytest.StashKey[TruthCache | None]()
collector_key = pytest.StashKey[object]()

MARKERS = {
    "operator": "an operator alignment test (operator x candidate x dtype x case)",
    "model": "a full-model replay test over a golden set",
    "layer": "a layer replay test over one capture point of a golden set",
    "decode": "a decode replay test (KV cache or paged serving) over a golden set",
    "smoke": "runs at every tier (smoke, pr, nightly)",
    "pr": "runs at tiers pr and nightly (deselected at smoke)",
    "nightly": "runs at tier nightly only",
    "replay_group": "replay_group(name): a model-suite test's set and dtype; an engine that "
    "serves one model at a time runs a group's tests together",
}

# (option, ini key, help, extra add_option kwargs, ini type, default)
_OPTIONS: list[tuple[str, str, str, dict[str, Any], str, Any]] = [
    (
        "--device",
        "numalign_device",
        "where candidates run: auto (first of cuda, xpu, npu, mps, else cpu), cpu, cuda:1, ...",
        {},
        "string",
        "auto",
    ),
    (
        "--device-plugin",
        "numalign_device_plugins",
        "module imported before device detection, e.g. a vendor's torch extension (repeatable)",
        {"action": "append"},
        "linelist",
        [],
    ),
    (
        "--dtype",
        "numalign_dtype",
        f"comma list of dtypes candidates run in (default {','.join(DEFAULT_DTYPES)})",
        {},
        "string",
        ",".join(DEFAULT_DTYPES),
    ),
    (
        "--tier",
        "numalign_tier",
        f"case grid size: {', '.join(TIERS)} (default {DEFAULT_TIER})",
        {},
        "string",
        DEFAULT_TIER,
    ),
    (
        "--golden",
        "numalign_golden",
        "extra golden set folder (repeatable)",
        {"action": "append"},
        "paths",
        [],
    ),
    (
        "--golden-only",
        "numalign_golden_only",
        "model suites replay only the --golden sets, not <rootdir>/golden/sets (numalign run "
        "replays the set of its model alone)",
        {"action": "store_true", "default": None},
        "bool",
        False,
    ),
    (
        "--candidates",
        "numalign_candidates",
        "module that registers candidates with @numalign.candidate (repeatable)",
        {"action": "append"},
        "linelist",
        [],
    ),
    (
        "--report-dir",
        "numalign_report_dir",
        "where run reports go (default reports/)",
        {},
        "string",
        "reports",
    ),
    (
        "--drift-baseline",
        "numalign_drift_baseline",
        "a run folder or records.jsonl to compare this run against",
        {},
        "string",
        "",
    ),
    (
        "--regression-factor",
        "numalign_regression_factor",
        "a record regresses when its use of budget grows beyond this factor (default 2)",
        {},
        "string",
        "2.0",
    ),
    (
        "--fail-on-regression",
        "numalign_fail_on_regression",
        "fail the session when a record regressed against --drift-baseline",
        {"action": "store_true", "default": None},
        "bool",
        False,
    ),
    (
        "--history",
        "numalign_history",
        "history file runs are appended to (default <report-dir>/history.jsonl)",
        {},
        "string",
        "",
    ),
    (
        "--swap",
        "numalign_swap",
        "OPERATOR=CANDIDATE: run models with every module the operator stands for replaced by "
        "the candidate (repeatable; all=NAME takes a candidate set)",
        {"action": "append"},
        "linelist",
        [],
    ),
    (
        "--attn-implementation",
        "numalign_attn_implementation",
        "transformers attention implementation for model replay: eager or one transformers "
        "offers (" + ", ".join(ATTN_IMPLEMENTATIONS) + ", flash_attention_2, ...)",
        {},
        "string",
        "",
    ),
    (
        "--engine",
        "numalign_engine",
        "what replays the model suites' models: transformers (the reference's modelling "
        "code) or vllm (vLLM's own model code, its modules mapped to the capture points; "
        "see docs/vllm.md)",
        {},
        "string",
        "transformers",
    ),
    (
        "--vllm-memory",
        "numalign_vllm_memory",
        "share of the device's memory (on CPU: of RAM) vLLM reserves for its KV cache "
        f"(gpu_memory_utilization; default {DEFAULT_VLLM_MEMORY})",
        {},
        "string",
        str(DEFAULT_VLLM_MEMORY),
    ),
    (
        "--experts-implementation",
        "numalign_experts_implementation",
        "transformers experts implementation of MoE models for model replay: eager, "
        "batched_mm, grouped_mm",
        {},
        "string",
        "",
    ),
    (
        "--cache-implementation",
        "numalign_cache_implementation",
        "comma list of what decode replay runs with: "
        + ", ".join(CACHE_IMPLEMENTATIONS)
        + f" (default {','.join(DEFAULT_CACHE_IMPLEMENTATIONS)})",
        {},
        "string",
        ",".join(DEFAULT_CACHE_IMPLEMENTATIONS),
    ),
    (
        "--shard",
        "numalign_shard",
        "I/N: run only the I-th of N shards of the tests, split by a stable hash of test ids "
        "(join the runs with numalign report merge)",
        {},
        "string",
        "",
    ),
    (
        "--allow-tf32",
        "numalign_allow_tf32",
        "allow TF32 matmuls on CUDA (off by default)",
        {"action": "store_true", "default": None},
        "bool",
        False,
    ),
    (
        "--truth-cache",
        "numalign_truth_cache",
        "folder of the operator suite's cached float64 truths, relative to the rootdir "
        "(default .numalign-cache/truths, or $NUMALIGN_CACHE/truths); off: no cache",
        {},
        "string",
        "",
    ),
    (
        "--truth-cache-size",
        "numalign_truth_cache_size",
        "size the truth cache is kept under, least recently used entries evicted first "
        "(4GB, 500MB, 2GiB; 0: no cap; default 4GB)",
        {"metavar": "SIZE"},
        "string",
        "4GB",
    ),
    (
        "--keep-runs",
        "numalign_keep_runs",
        "run folders the report folder keeps: older runs are removed at the end of a session, "
        "never the latest nor the baseline (0: keep every run; default 10)",
        {"metavar": "N"},
        "string",
        "10",
    ),
    (
        "--compile",
        "numalign_compile",
        "run candidates, layers and models through torch.compile with this backend (default "
        "inductor when given without a value; any registered backend, a vendor's through "
        "--device-plugin); records name it in swap",
        {"nargs": "?", "const": "inductor", "metavar": "BACKEND"},
        "string",
        "",
    ),
    (
        "--compile-mode",
        "numalign_compile_mode",
        "torch.compile mode with --compile: default, reduce-overhead, max-autotune, "
        "max-autotune-no-cudagraphs",
        {},
        "string",
        "",
    ),
    (
        "--tp",
        "numalign_tp",
        "replay models tensor-parallel on N ranks of torch.distributed (transformers' "
        "tp_plan; gloo on cpu, nccl/xccl/hccl on accelerators); each xdist worker launches its "
        "own group of N ranks with torchrun",
        {"metavar": "N"},
        "string",
        "1",
    ),
    (
        "--tp-launcher",
        "numalign_tp_launcher",
        "the command that starts the --tp ranks, for several machines (e.g. srun ... torchrun "
        "--nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500); "
        "numalign appends '-m numalign.replay.tp_rank --connect HOST:PORT'. Default: torchrun "
        "--standalone with N processes on this machine",
        {"metavar": "COMMAND"},
        "string",
        "",
    ),
    (
        "--tp-timeout",
        "numalign_tp_timeout",
        "seconds one replay may take on the tensor-parallel ranks before a hung rank is "
        "stopped and its test fails",
        {"metavar": "SECONDS"},
        "string",
        "600",
    ),
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("numalign", "numalign: numerical alignment of models and operators")
    for option, ini, help_text, kwargs, ini_type, default in _OPTIONS:
        dest = ini
        group.addoption(option, dest=dest, help=f"{help_text} [ini: {ini}]", **kwargs)
        parser.addini(ini, help_text, type=ini_type, default=default)  # type: ignore[arg-type]


def _value(config: pytest.Config, ini: str) -> Any:
    value = config.getoption(ini)
    return config.getini(ini) if value is None or value == [] else value


def settings_from_config(config: pytest.Config) -> Settings:
    """Validated settings from options and ini keys; pytest.UsageError on bad values."""
    try:
        device = validate_device(str(_value(config, "numalign_device")))
        dtypes = parse_dtypes(str(_value(config, "numalign_dtype")))
        tier = parse_tier(str(_value(config, "numalign_tier")))
        shard = parse_shard(str(_value(config, "numalign_shard") or ""))
        caches = parse_cache_implementations(str(_value(config, "numalign_cache_implementation")))
        tp = parse_tp(str(_value(config, "numalign_tp")))
        tp_timeout = parse_seconds(str(_value(config, "numalign_tp_timeout")), "--tp-timeout")
        engine = parse_engine(str(_value(config, "numalign_engine") or ""))
        vllm_memory = parse_share(str(_value(config, "numalign_vllm_memory")), "--vllm-memory")
        cache_size = parse_size(str(_value(config, "numalign_truth_cache_size")),
                                "--truth-cache-size")  # fmt: skip
        keep_runs = parse_count(str(_value(config, "numalign_keep_runs")), "--keep-runs")
        experts = parse_experts_implementation(
            str(_value(config, "numalign_experts_implementation") or "")
        )
    except ValueError as exc:
        raise pytest.UsageError(f"numalign: {exc}") from None
    golden = tuple(Path(p) for p in _value(config, "numalign_golden"))
    if not golden and _value(config, "numalign_golden_only"):
        raise pytest.UsageError(
            "numalign: --golden-only replays the --golden sets alone, and none was given: "
            "add --golden SET_FOLDER"
        )
    for folder in golden:
        if not folder.is_dir():
            raise pytest.UsageError(
                f"numalign: --golden {folder}: no such folder; pass a golden set folder or a "
                "folder of sets (see numalign capture)"
            )
    baseline = str(_value(config, "numalign_drift_baseline") or "")
    if baseline and not Path(baseline).exists():
        raise pytest.UsageError(
            f"numalign: --drift-baseline {baseline}: no such run folder or records file"
        )
    if baseline:
        _check_baseline(Path(baseline))
    try:
        factor = float(_value(config, "numalign_regression_factor"))
    except ValueError:
        factor = 0.0
    if not factor > 1.0:
        raise pytest.UsageError("numalign: --regression-factor must be a number above 1")
    history = str(_value(config, "numalign_history") or "")
    try:
        attn = parse_attn_implementation(str(_value(config, "numalign_attn_implementation") or ""))
    except ValueError as exc:
        raise pytest.UsageError(f"numalign: {exc}") from None
    settings = Settings(
        device=device,
        device_plugins=tuple(_value(config, "numalign_device_plugins")),
        dtypes=dtypes,
        tier=tier,
        golden_dirs=golden,
        golden_only=bool(_value(config, "numalign_golden_only")),
        candidate_modules=tuple(_value(config, "numalign_candidates")),
        report_dir=Path(str(_value(config, "numalign_report_dir"))),
        baseline=Path(baseline) if baseline else None,
        regression_factor=factor,
        fail_on_regression=bool(_value(config, "numalign_fail_on_regression")),
        history=Path(history) if history else None,
        swaps=tuple(_value(config, "numalign_swap")),
        shard=shard,
        attn_implementation=attn,
        experts_implementation=experts,
        allow_tf32=bool(_value(config, "numalign_allow_tf32")),
        cache_implementations=caches,
        truth_cache=resolve_truth_folder(
            str(_value(config, "numalign_truth_cache") or ""), config.rootpath
        ),
        truth_cache_max_bytes=cache_size,
        keep_runs=keep_runs,
        compile_backend=str(_value(config, "numalign_compile") or "").strip() or None,
        compile_mode=str(_value(config, "numalign_compile_mode") or "").strip() or None,
        tp=tp,
        tp_timeout=tp_timeout,
        tp_launcher=str(_value(config, "numalign_tp_launcher") or "").strip() or None,
        engine=engine,
        vllm_memory=vllm_memory,
    )
    conflict = engine_conflicts(settings)
    if conflict:
        raise pytest.UsageError(f"numalign: {conflict}")
    return settings


def _check_baseline(path: Path) -> None:
    """The baseline is a run's records, read now: a wrong path fails before the first test,
    not after the whole run."""
    from numalign.record import read_records

    try:
        read_records(path)
    except (OSError, ValueError) as exc:
        raise pytest.UsageError(
            f"numalign: --drift-baseline {path}: {exc}; give a run folder under --report-dir "
            "(reports/<run-id>/) or its records.jsonl"
        ) from None


def _import_all(modules: tuple[str, ...], what: str) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise pytest.UsageError(
                f"numalign: {what} {name!r} failed to import: {type(exc).__name__}: {exc}. "
                "Check that it is installed in this environment and on sys.path."
            ) from None


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    settings = settings_from_config(config)
    config.stash[settings_key] = settings
    config.stash[previous_truth_cache_key] = use_truth_cache(
        settings.truth_cache, settings.truth_cache_max_bytes
    )
    _import_all(settings.device_plugins, "--device-plugin")
    if settings.device not in ("auto", "cpu"):
        from numalign.runtime import DeviceUnavailableError, resolve_device

        try:
            resolve_device(settings.device)
        except DeviceUnavailableError as exc:
            raise pytest.UsageError(f"numalign: {exc}") from None
    _import_all(settings.candidate_modules, "--candidates")
    if settings.compile_backend or settings.compile_mode:
        _check_compile(settings)
    if settings.tp > 1 and settings.compile_backend:
        raise pytest.UsageError(
            "numalign: --tp and --compile together are not supported yet: replay tensor-parallel "
            "eager (--tp N), and compiled on one process (--compile)"
        )
    if settings.swaps:
        from numalign.registry import RegistryError
        from numalign.replay.swap import SwapError, parse_swaps

        try:
            parse_swaps(settings.swaps)
        except (SwapError, RegistryError) as exc:
            raise pytest.UsageError(f"numalign: {exc}") from None
    if not hasattr(config, "workerinput"):  # the xdist controller, or a plain session
        from numalign.report import DriftCollector
        from numalign.selection import RanNothingGuard

        collector = DriftCollector(settings)
        config.stash[collector_key] = collector
        config.pluginmanager.register(collector, "numalign-drift")
        config.pluginmanager.register(RanNothingGuard(), "numalign-ran-nothing")


def _check_compile(settings: Settings) -> None:
    """The --compile backend is registered (after --device-plugin imported a vendor's) and
    the mode known; a usage error naming the registered backends otherwise."""
    if not settings.compile_backend:
        raise pytest.UsageError("numalign: --compile-mode needs --compile [BACKEND]")
    from numalign.runtime.compiled import validate_spec

    try:
        validate_spec(settings.compile_backend, settings.compile_mode)
    except ValueError as exc:
        hint = ""
        if Path(settings.compile_backend.split("::")[0]).exists():
            hint = (
                f" ({settings.compile_backend!r} is a path: write --compile=BACKEND, or put "
                "--compile after the paths)"
            )
        raise pytest.UsageError(f"numalign: {exc}{hint}") from None


def pytest_unconfigure(config: pytest.Config) -> None:
    if previous_truth_cache_key in config.stash:  # an in-process run leaves the outer one's
        restore_truth_cache(config.stash[previous_truth_cache_key])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselects tests marked for a tier above the selected one, and tests of other shards."""
    settings = config.stash[settings_key]
    rank = settings.tier_rank()
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        marked = [TIERS.index(t) for t in TIERS if item.get_closest_marker(t)]
        above = bool(marked) and min(marked) > rank
        (drop if above or not in_shard(item.nodeid, settings.shard) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if settings.engine != "transformers":  # one model at a time: each group's tests together
        from numalign.replay.engines import group_tests

        group_tests(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """After every selection (tiers, shards, -k): a --swap that matches no module of any
    model the selected tests replay is a usage error, before any test runs (a model without
    it among others that have it skips its tests with the reason)."""
    settings = session.config.stash[settings_key]
    if not settings.swaps:
        return
    sets = {
        str(mark.args[0]).rpartition("-")[0]  # the group: SET_PATH-DTYPE
        for item in session.items
        if (mark := item.get_closest_marker("replay_group")) is not None and mark.args
    }
    if not sets:
        return
    from numalign.replay.swap import module_types, parse_swaps, unmatched

    problems = _unmatched_swaps(sets, parse_swaps(settings.swaps), module_types, unmatched)
    if problems:
        raise pytest.UsageError("numalign: " + "; ".join(problems))


def _unmatched_swaps(sets: set[str], swaps: Any, module_types: Any, unmatched: Any) -> list[str]:
    from numalign.golden import GoldenSet, GoldenSetError

    types: set[str] = set()
    for path in sorted(sets):
        try:
            types |= module_types(GoldenSet.open(path).model_dir)
        except (GoldenSetError, OSError, ValueError):
            return []  # a set that cannot be read fails its own tests with its own message
    return list(unmatched(swaps, types))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "numalign_dtype" in metafunc.fixturenames:
        dtypes = metafunc.config.stash[settings_key].dtypes
        metafunc.parametrize("numalign_dtype", dtypes, ids=list(dtypes), indirect=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A numalign test that raised (setup or call) gets a drift record with verdict
    ``error``: a candidate, a model or a replay that broke is in the report, never missing."""
    report = yield
    if report.failed and report.when in ("setup", "call") and _records_drift(item):
        from numalign.record import error_record_for

        record = error_record_for(
            item.nodeid, call.excinfo, report.user_properties,
            device=item.config.stash[settings_key].device,
        )  # fmt: skip
        if record is not None:
            report.user_properties.append(record)
    return report


def _records_drift(item: pytest.Item) -> bool:
    return "record_drift" in getattr(item, "fixturenames", ())


@pytest.fixture(scope="session")
def numalign_settings(pytestconfig: pytest.Config) -> Settings:
    """The validated numalign settings of this session."""
    return pytestconfig.stash[settings_key]


@pytest.fixture(scope="session")
def numalign_device(numalign_settings: Settings) -> torch.device:
    """The device candidates run on; sets up torch for this worker on first use."""
    from numalign.runtime import configure_torch, resolve_device, threads_per_worker

    configure_torch(threads=threads_per_worker(), allow_tf32=numalign_settings.allow_tf32)
    return resolve_device(numalign_settings.device)


@pytest.fixture
def numalign_dtype(request: pytest.FixtureRequest) -> torch.dtype:
    """One of the session's dtypes (tests using it are parametrized over ``--dtype``)."""
    import torch

    dtype: torch.dtype = getattr(torch, request.param)
    return dtype


@pytest.fixture
def record_drift(request: pytest.FixtureRequest) -> NodeRecorder:
    """Records a comparison of this test: ``record_drift(result, suite=..., candidate=...,
    device=..., case=...)``; the controller writes it to the run's records.jsonl."""
    from numalign.record import NodeRecorder

    allure_on = bool(request.config.getoption("allure_report_dir", None))
    annotate = _allure_annotate() if allure_on else None
    return NodeRecorder(request.node.nodeid, request.node.user_properties, annotate)


def _allure_annotate() -> Any:
    from numalign.report.allure import Annotator

    return Annotator()


@pytest.fixture(scope="session")
def tolerance_policy(pytestconfig: pytest.Config) -> TolerancePolicy:
    """Tolerance overrides from ``[tool.numalign]`` in the project's pyproject.toml."""
    from numalign.compare import load_policy

    return load_policy(pytestconfig.rootpath / "pyproject.toml")
