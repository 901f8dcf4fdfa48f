"""Shared set-up of the model suites: the per-worker replay engine (``--engine``), and the
guard every replay runs in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest

from numalign.record import NodeRecorder
from numalign.record_errors import recorded_errors
from numalign.replay.engines import Engine, open_engine
from numalign.replay.model import unusable_sets
from numalign.runtime.variant import Variant
from numalign.testids import Param

#: The parameters of the model suites' tests, each a ``testids.Param`` whose values are a
#: ``testids.ReplayCase`` (test_layers, test_model, test_decode).
CASE_PARAMS = ("layer_case", "model_case", "decode_case")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A golden set replay cannot use (stale, its model folder gone) fails once: its first
    test runs and fails with the message that says how to fix it; its other tests are skipped
    with the reason, so a stale set is one failure, not one per point."""
    sets: dict[pytest.Item, str] = {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        case = next((params[k] for k in CASE_PARAMS if k in params), None)
        if isinstance(case, Param):
            sets[item] = case.values.path
    unusable = unusable_sets(list(sets.values()))
    first: dict[str, str] = {}
    for item, path in sets.items():
        if path not in unusable:
            continue
        if path not in first:
            first[path] = item.nodeid
            continue
        reason = unusable[path].splitlines()[0]
        item.add_marker(pytest.mark.skip(reason=f"{reason} (failed once: {first[path]})"))


@pytest.fixture(scope="session")
def replay_engine(numalign_settings: Any) -> Iterator[Engine]:
    """The session's engine, once per worker: transformers (models loaded once per set,
    device, dtype and variant; under --tp, the worker's group of ranks) or vLLM (one engine
    at a time per worker), stopped when the session ends."""
    engine = open_engine(numalign_settings)
    yield engine
    engine.close()


@pytest.fixture
def replay_guard(
    record_drift: NodeRecorder, numalign_settings: Any
) -> Callable[[], AbstractContextManager[None]]:
    """The guard every replay runs in: what its failures become is numalign's one exception
    policy (``numalign.record_errors``: stale or broken golden data, a compiler's failure, a
    tensor-parallel rank or the serving engine that raised or died, a path the model cannot
    take here); records carry the session's execution variant."""
    # the records' variant fields (the cache is the test's own: not known here)
    variant = Variant.from_settings(numalign_settings).record_fields()
    return lambda: recorded_errors(record_drift, **variant)
