"""The timer every benchmark shares (imported as ``timing`` by the scripts beside it)."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``fn``, in seconds: the run least disturbed by other
    work on a shared machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
