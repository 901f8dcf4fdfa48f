"""Shared set-up of the model suites: the per-worker replay engine (``--engine``), and the
guard every replay runs in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest

from numalign.golden import GoldenSetError
from numalign.records.drift import NodeRecorder
from numalign.records.outcomes import recorded_errors
from numalign.records.testids import Param
from numalign.replay.engines import Engine, open_engine
from numalign.replay.sets import unusable_sets
from numalign.runtime.variant import Variant

#: The parameters of the model suites' tests, each a ``testids.Param`` whose values are a
#: ``testids.ReplayCase`` (test_layers, test_model, test_decode).
CASE_PARAMS = ("layer_case", "model_case", "decode_case")


#: The message a test of a set replay cannot use fails with, where another selected test of
#: the set fails with the set's own (``pytest_collection_modifyitems``).
_BROKEN = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every selected test of a golden set replay cannot use (stale, its model folder gone,
    its manifest unreadable) fails. Its first selected test runs and fails with the message
    that says how to fix it; its other selected tests fail at once with that message's first
    line, naming that test, without opening the set again (a stale model is hashed once, not
    once per point). Last of the hooks, so after ``-k``, ``-m``, tiers and shards have
    deselected: a ``-k`` that leaves out the set's first test still fails its others."""
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
        item.stash[_BROKEN] = f"{reason} (the whole message is its first test's: {first[path]})"


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
    request: pytest.FixtureRequest, record_drift: NodeRecorder, numalign_settings: Any
) -> Callable[[], AbstractContextManager[None]]:
    """The guard every replay runs in: what its failures become is numalign's one exception
    policy (``numalign.records.outcomes``: stale or broken golden data, a compiler's failure, a
    tensor-parallel rank or the serving engine that raised or died, a path the model cannot
    take here); records carry the session's execution variant. A test of a set replay cannot
    use, other than its first selected test, fails in it at once with the set's error."""
    # the records' variant fields (the cache is the test's own: not known here)
    variant = Variant.from_settings(numalign_settings).record_fields()
    broken = request.node.stash.get(_BROKEN, None)
    if broken is None:
        return lambda: recorded_errors(record_drift, **variant)
    return lambda: _broken_set(record_drift, broken, variant)


@contextmanager
def _broken_set(
    record_drift: NodeRecorder, message: str, variant: dict[str, Any]
) -> Iterator[None]:
    """A guard whose test fails with the error of its set (``message``) before it replays:
    an ``error`` record and a failure, as the set's own error gives its first test."""
    __tracebackhide__ = True
    with recorded_errors(record_drift, **variant):
        raise GoldenSetError(message)
    yield  # never reached: recorded_errors ends the test
