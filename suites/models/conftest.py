"""Shared set-up of the model suites: golden sets (golden/sets and each --golden DIR), a
per-worker model cache, and parametrization by set, point and dtype."""

from __future__ import annotations

from pathlib import Path

import pytest

from numalign.golden import GoldenSet
from numalign.plugin import settings_key
from numalign.replay.model import ModelCache, discover_sets

ROOT = Path(__file__).resolve().parents[2]


def golden_sets(config: pytest.Config) -> list[Path]:
    settings = config.stash[settings_key]
    return discover_sets([ROOT / "golden" / "sets", *settings.golden_dirs])


@pytest.fixture(scope="session")
def model_cache() -> ModelCache:
    """Models loaded once per worker for each (set, device, dtype, swaps)."""
    return ModelCache()


def open_fresh(path: str) -> GoldenSet:
    """The golden set, failing the test with the stale message when its model changed."""
    from numalign.golden import GoldenSetError

    try:
        golden = GoldenSet.open(path)
        golden.check_fresh()
    except GoldenSetError as exc:
        pytest.fail(str(exc), pytrace=False)
    return golden
