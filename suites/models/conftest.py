"""Shared set-up of the model suites: a per-worker model cache."""

from __future__ import annotations

import pytest

from numalign.replay.model import ModelCache


@pytest.fixture(scope="session")
def model_cache() -> ModelCache:
    """Models loaded once per worker for each (set, device, dtype, swaps)."""
    return ModelCache()
