"""Wall time per phase of the operator checks, summed per process.

``check_operator`` times its phases (``inputs``: drawing and rounding the case's inputs;
``truth``: the float64 reference; ``cache``: reading and writing the on-disk truth cache;
``control``: the reference in the target dtype; ``candidate``; ``compare``), and the operator
suite times ``records`` (building the drift records). The sums cost two ``perf_counter``
calls per phase; ``bench/bench_suite.py`` reads them at the end of each worker to show where
a suite's time goes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

#: The phases, in the order a check runs them.
PHASES: tuple[str, ...] = ("inputs", "truth", "cache", "control", "candidate", "compare", "records")

_totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Adds the wall time of the ``with`` body to phase ``name`` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _totals[name] = _totals.get(name, 0.0) + time.perf_counter() - start


def add_phase(name: str, seconds: float) -> None:
    """Adds ``seconds`` to phase ``name`` (for a span that is not one block)."""
    _totals[name] = _totals.get(name, 0.0) + seconds


def phase_totals() -> dict[str, float]:
    """Seconds spent in each phase by this process so far."""
    return dict(_totals)


def reset_phases() -> None:
    for name in list(_totals):
        _totals[name] = 0.0
