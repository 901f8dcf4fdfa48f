"""Shared set-up of the model suites: a per-worker model cache, and the guard every replay
runs in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest

from numalign.golden import GoldenSetError
from numalign.record import NodeRecorder
from numalign.replay.compiled import CompileError
from numalign.replay.model import ModelCache, ReplayUnsupported, variant_label
from numalign.replay.paged import PagedUnsupported


@pytest.fixture(scope="session")
def model_cache() -> ModelCache:
    """Models loaded once per worker for each (set, device, dtype, swaps)."""
    return ModelCache()


@pytest.fixture
def replay_guard(
    record_drift: NodeRecorder, numalign_settings: Any
) -> Callable[[], AbstractContextManager[None]]:
    """What a replay's failures become: stale, broken or corrupted golden data and a
    compiler's failure (``--compile``) fail the test with their own message and an ``error``
    record (the session goes on); a path transformers lacks for this model skips."""

    @contextmanager
    def guard() -> Iterator[None]:
        __tracebackhide__ = True
        try:
            yield
        except GoldenSetError as exc:
            record_drift.error(exc)
            pytest.fail(str(exc), pytrace=False)
        except (ReplayUnsupported, PagedUnsupported) as exc:
            pytest.skip(str(exc))
        except CompileError as exc:
            record_drift.error(exc, swap=variant_label(numalign_settings))
            pytest.fail(str(exc), pytrace=False)

    return guard
