"""The engines that replay a golden set's model, behind one interface: ``transformers`` (the
reference's own modelling code, with numalign's variants: attention and experts
implementations, kernel swaps, compilation, tensor parallel, KV caches) and ``vllm`` (the
serving engine's own model code, its modules mapped to the capture points).

A suite asks ``open_engine(settings)`` once per worker for the session's engine and calls
``layer``, ``model`` and ``decode``; each returns a ``Replayed``: the set, the verdict, the
fields every record of the test shares, and (for decode) why a failure is expected. What
cannot be replayed here is raised, never returned: an ``Unsupported`` (``NotJudged`` where
the engine has no counterpart for a point: the skip leaves a record). Adding an engine is a
new module here with these three methods and its name in ``settings.ENGINES``; the suites
and the reports do not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from numalign.core.errors import Unsupported

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet
    from numalign.session.settings import Settings


@dataclass
class Replayed:
    """One replay's outcome: the set, the verdict (a list of ``PointResult`` for a layer, a
    ``ModelVerdict``, a ``DecodeVerdict``), the record fields the test's records share, and
    for decode the reason a failure is expected (``known``)."""

    golden: GoldenSet
    verdict: Any
    context: dict[str, Any] = field(default_factory=dict)
    known: str | None = None


class NotJudged(Unsupported):
    """A point this engine cannot judge here (it has no counterpart for it, cannot run it
    alone, or runs compiled): the test skips with the reason and leaves a ``skipped`` record
    carrying the replay's record fields, so that the reports count the point per dtype."""

    rule = "skipped"

    def __init__(self, reason: str, fields: dict[str, Any]) -> None:
        super().__init__(reason)
        self.fields = dict(fields)

    def record_fields(self) -> dict[str, Any]:
        return dict(self.fields)


class Engine(Protocol):
    """What replays a golden set's model on the device."""

    name: str

    def layer(
        self, path: str | Path, point: str, dtype: str, device: torch.device, policy: Any
    ) -> Replayed:
        """Every recorded call of ``point`` run alone on the golden inputs."""
        ...

    def model(
        self,
        path: str | Path,
        dtype: str,
        device: torch.device,
        policy: Any,
        serving: str | None = None,
    ) -> Replayed:
        """The whole model on every golden request, every point and the logits judged;
        ``serving``: a serving engine's arrangement (``numalign.runtime.serving``; None: its
        default)."""
        ...

    def decode(
        self,
        path: str | Path,
        dtype: str,
        cache: str,
        device: torch.device,
        policy: Any,
        serving: str | None = None,
    ) -> Replayed:
        """Every golden decode, teacher-forced, with the KV cache ``cache``, served in the
        arrangement ``serving`` as ``model``."""
        ...

    def close(self) -> None:
        """Stops what the engine started (ranks, engine processes)."""
        ...


def engine_class(name: str) -> Any:
    """The class of the engine ``name`` (one of ``settings.ENGINES``); importing it imports
    nothing of the engine's own package (vLLM loads when the engine starts)."""
    if name == "vllm":
        from numalign.replay.engines.vllm import VllmEngine

        return VllmEngine
    from numalign.replay.engines.transformers import TransformersEngine

    return TransformersEngine


def open_engine(settings: Settings) -> Engine:
    """The session's engine (``settings.engine``), to keep for the worker's session."""
    engine: Engine = engine_class(settings.engine)(settings)
    return engine


def group_tests(items: list[Any]) -> None:
    """Orders ``items`` so that each replay group's tests run together (stable: the order
    within a group, and of tests without a group, is kept)."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        mark = item.get_closest_marker("replay_group")
        if mark is not None and mark.args:
            first.setdefault(str(mark.args[0]), i)

    def key(pair: tuple[int, Any]) -> tuple[int, int]:
        i, item = pair
        mark = item.get_closest_marker("replay_group")
        group = first.get(str(mark.args[0])) if mark is not None and mark.args else None
        return (i if group is None else group, i)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


def decode_caches(settings: Settings) -> tuple[str, ...]:
    """The KV caches the session's engine replays decode with, one test each (the engine's
    class says, at collection, before any engine starts)."""
    caches: tuple[str, ...] = engine_class(settings.engine).caches(settings)
    return caches
