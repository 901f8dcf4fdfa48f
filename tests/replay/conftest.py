"""Fixtures of the replay tests: one vLLM engine per test module (the vLLM tests import
vLLM first and skip where it is not installed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    """A vLLM engine with the default settings, serving every test of a module, closed after
    them (each holds its share of the machine's memory)."""
    from numalign.replay.engines.vllm import VllmEngine
    from numalign.session.settings import Settings

    served = VllmEngine(Settings(engine="vllm"))
    yield served
    served.close()
