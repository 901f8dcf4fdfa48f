"""The numalign pytest plugin: options, ini keys, markers, fixtures. Thin by design: every
behaviour lives in the library; torch is imported only by fixtures that need it."""

from __future__ import annotations

import gc
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from numalign.ops.truths import (
    CacheSecretError,
    TruthCache,
    resolve_truth_folder,
    restore_truth_cache,
    use_truth_cache,
)
from numalign.records.testids import parse_replay_group
from numalign.session.option_values import TIERS
from numalign.session.options import OPTIONS
from numalign.session.settings import Settings, in_shard

if TYPE_CHECKING:
    import torch

    from numalign.compare import TolerancePolicy
    from numalign.records.drift import NodeRecorder

settings_key = pytest.StashKey[Settings]()
previous_truth_cache_key = pytest.StashKey[TruthCache | None]()
collector_key = pytest.StashKey[object]()
#: Sessions configured in this process and not yet unconfigured (an in-process run of
#: pytest inside another, pytester's, is the second).
_sessions = 0
#: The usage error a test of an xdist worker fails with (``pytest_collection_finish``).
usage_error_key = pytest.StashKey[str]()

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


def pytest_addoption(parser: pytest.Parser) -> None:
    """Registers every option of ``numalign.session.options`` with its ini key."""
    group = parser.getgroup("numalign", "numalign: numerical alignment of models and operators")
    for opt in OPTIONS:
        group.addoption(
            opt.flag, dest=opt.ini, help=f"{opt.help} [ini: {opt.ini}]", **opt.argparse_kwargs()
        )
        parser.addini(opt.ini, opt.help, type=opt.ini_type, default=opt.default)  # type: ignore[arg-type]


def _value(config: pytest.Config, ini: str) -> Any:
    value = config.getoption(ini)
    return config.getini(ini) if value is None or value == [] else value


def settings_from_config(config: pytest.Config) -> Settings:
    """Validated settings from options and ini keys (``Settings.from_options``), the truth
    cache's folder resolved against the rootdir; pytest.UsageError on bad values."""
    values = {opt.name: _value(config, opt.ini) for opt in OPTIONS}
    values["truth_cache"] = resolve_truth_folder(str(values["truth_cache"] or ""), config.rootpath)
    try:
        return Settings.from_options(values)
    except ValueError as exc:
        raise pytest.UsageError(f"numalign: {exc}") from None


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
    global _sessions
    _sessions += 1
    settings = settings_from_config(config)
    config.stash[settings_key] = settings
    try:
        config.stash[previous_truth_cache_key] = use_truth_cache(
            settings.truth_cache, settings.truth_cache_max_bytes
        )
    except CacheSecretError as exc:
        raise pytest.UsageError(f"numalign: {exc}") from None
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
        from numalign.ops.registry import RegistryError
        from numalign.replay.swap import SwapError, parse_swaps

        try:
            parse_swaps(settings.swaps)
        except (SwapError, RegistryError) as exc:
            raise pytest.UsageError(f"numalign: {exc}") from None
    if not hasattr(config, "workerinput"):  # the xdist controller, or a plain session
        from numalign.report import DriftCollector
        from numalign.session.selection import RanNothingGuard

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


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if previous_truth_cache_key in config.stash:  # an in-process run leaves the outer one's
        restore_truth_cache(config.stash[previous_truth_cache_key])
    # After the last hook, pytest's unraisable-exception cleanup collects garbage five times
    # over the whole heap, where the controller holds every record two or three times over
    # (the collector's, and each phase's report's user properties): seconds of silence after
    # pytest's last line in a large run (docs/measurements.md). Every report is written by
    # now: the records leave the heap. An in-process run inside another session (pytester)
    # leaves the outer one's reports alone.
    global _sessions
    _sessions -= 1
    if _sessions == 0:
        release_records(config)


def release_records(config: pytest.Config) -> None:
    """Drops the session's records from the heap once every report is written: the
    collector's, and the drift records among the test reports' user properties."""
    from numalign.records.drift import USER_PROPERTY

    collector = config.stash.get(collector_key, None)
    if collector is not None:
        collector.release()  # type: ignore[attr-defined]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    for reports in getattr(reporter, "stats", {}).values():
        for report in reports:
            properties = getattr(report, "user_properties", None)
            if properties:
                report.user_properties = [p for p in properties if p[0] != USER_PROPERTY]


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
    it among others that have it skips its tests with the reason). In an xdist worker, which
    has already sent its tests to the controller, a usage error would end its session with
    them unreported (xdist's INTERNALERROR): there each of those tests fails at its setup with
    the usage error's message instead.

    What collection imported (torch, transformers, the suites) lives as long as the session:
    once collection's own garbage is collected, it is moved out of the garbage collector's
    view (``gc.freeze``), so that the full collections others run (transformers' paged
    engine at each stop, pytest at exit) scan only what the tests create."""
    gc.collect()
    gc.freeze()
    settings = session.config.stash[settings_key]
    if not settings.swaps:
        return
    replays = {
        item: parse_replay_group(str(mark.args[0]))[0]
        for item in session.items
        if (mark := item.get_closest_marker("replay_group")) is not None and mark.args
    }
    if not replays:
        return
    from numalign.replay.swap import parse_swaps, unmatched_in_sets

    problems = unmatched_in_sets(set(replays.values()), parse_swaps(settings.swaps))
    if not problems:
        return
    message = "numalign: " + "; ".join(problems)
    if not hasattr(session.config, "workerinput"):
        raise pytest.UsageError(message)
    for item in replays:
        item.stash[usage_error_key] = message


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test of an xdist worker whose session's options are a usage error fails with it."""
    message = item.stash.get(usage_error_key, None)
    if message is not None:
        pytest.fail(message, pytrace=False)


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
        from numalign.records.outcomes import error_property_for

        record = error_property_for(
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
    from numalign.core.dtypes import torch_dtype

    return torch_dtype(request.param)


@pytest.fixture
def record_drift(request: pytest.FixtureRequest) -> NodeRecorder:
    """Records a comparison of this test: ``record_drift(result, suite=..., candidate=...,
    device=..., case=...)``; the controller writes it to the run's records.jsonl."""
    from numalign.records.drift import NodeRecorder

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
