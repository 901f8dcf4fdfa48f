"""What a serving engine's failures become in a replay (``suites/models/conftest``)."""

from __future__ import annotations

from numalign.core.errors import Crashed, Unsupported


class EngineUnsupported(Unsupported, RuntimeError):
    """The engine cannot serve this model or this path (an architecture it lacks, a head dim
    its attention does not take): the test skips with the engine's own reason."""


class EngineError(Crashed, RuntimeError):
    """The engine failed to start, failed serving, or outlived its timeout: an ``error``
    record (``crashed`` when the engine died or hung); the engine is stopped and the next
    test starts a fresh one."""

    def __init__(self, message: str, *, crashed: bool = False) -> None:
        super().__init__(message)
        self.crashed = crashed
