"""Fixtures of the replay tests: one vLLM engine per test module (the vLLM tests import
vLLM first and skip where it is not installed), and a wrong RMSNorm kernel to swap in."""

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


@pytest.fixture(scope="module")
def wrong_kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """``--swap``'s text for an RMSNorm candidate with an epsilon of 1e-2 whatever the
    model's (1e-6), registered under a name of the requesting module's own while its tests
    run (in process: no other module's registry sees it)."""
    import numalign
    from numalign.ops.registry import _CANDIDATES, load_catalogue

    load_catalogue()
    from operators.norms import rms_norm_reference

    name = f"{request.module.__name__.rpartition('.')[2]}_wrong_eps"

    @numalign.candidate("rms_norm", name=name)
    def wrong_eps(x: Any, weight: Any, eps: float, offset: float = 0.0) -> Any:
        return rms_norm_reference(x, weight, 1e-2, offset)

    yield f"rms_norm={name}"
    del _CANDIDATES["rms_norm"]._entries[name]
