"""Shared set-up of the model suites: the per-worker replay engine (``--engine``), and the
guard every replay runs in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest

from numalign.golden import GoldenSetError
from numalign.golden.reference import CacheUnsupported
from numalign.record import NodeRecorder
from numalign.replay.engines import Engine, open_engine
from numalign.replay.engines.errors import EngineError, EngineUnsupported
from numalign.replay.layer import AloneUnsupported
from numalign.replay.model import ReplayUnsupported, unusable_sets
from numalign.replay.paged import PagedUnsupported
from numalign.replay.tensor_parallel import (
    NoTensorParallelPlan,
    TensorParallelError,
    TensorParallelUsageError,
)
from numalign.runtime.compiled import CompileError
from numalign.runtime.variant import Variant

#: The parameters of the model suites' tests, each "SET_PATH::..." (test_layers, test_model,
#: test_decode).
CASE_PARAMS = ("layer_case", "model_case", "decode_case")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A golden set replay cannot use (stale, its model folder gone) fails once: its first
    test runs and fails with the message that says how to fix it; its other tests are skipped
    with the reason, so a stale set is one failure, not one per point."""
    sets: dict[pytest.Item, str] = {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        case = next((params[k] for k in CASE_PARAMS if k in params), None)
        if isinstance(case, str) and "::" in case:
            sets[item] = case.partition("::")[0]
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
    """What a replay's failures become: stale, broken or corrupted golden data, a
    compiler's failure (``--compile``), a model that does not split over ``--tp`` ranks and
    a tensor-parallel rank that raised fail the test with their own message and an ``error``
    record (a known compiler bug is an expected failure, its record kept); a rank that died
    or hung fails it with a ``crashed`` record (the session goes on:
    the group was stopped, the next test starts a fresh one); a path transformers lacks for
    this model skips, as does a model the serving engine does not support (with its
    reason); an engine that fails to start or to serve fails the test with an ``error`` (or
    ``crashed``) record, and the next test starts it afresh."""

    # the records' variant fields (the cache is the test's own: not known here)
    variant = Variant.from_settings(numalign_settings).record_fields()

    @contextmanager
    def guard() -> Iterator[None]:
        __tracebackhide__ = True
        try:
            yield
        except GoldenSetError as exc:
            record_drift.error(exc)
            pytest.fail(str(exc), pytrace=False)
        except (
            ReplayUnsupported,
            PagedUnsupported,
            CacheUnsupported,
            AloneUnsupported,
            NoTensorParallelPlan,
            EngineUnsupported,
        ) as exc:
            pytest.skip(str(exc))
        except CompileError as exc:
            record_drift.error(exc, **variant, **exc.record_fields())
            if exc.known:  # an upstream compiler bug: expected while it lasts, recorded
                pytest.xfail(f"known compiler bug: {exc.known}\n{exc}")
            pytest.fail(str(exc), pytrace=False)
        except TensorParallelUsageError as exc:
            record_drift.error(exc, **variant)
            pytest.fail(str(exc), pytrace=False)
        except (TensorParallelError, EngineError) as exc:  # a rank, or the serving engine
            if exc.crashed:
                record_drift.crashed(str(exc).splitlines()[0], str(exc), **variant)
            else:
                record_drift.error(exc, **variant)
            pytest.fail(str(exc), pytrace=False)

    return guard
