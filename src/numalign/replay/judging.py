"""Every engine's way to the one judge: the engine's observation run (``observe(see)``: it
runs the model and hands each tensor to ``see``, returning the points it has no counterpart
for) handed to a ``compare.model_judge.ModelJudge`` of the replay's mode, and the verdict
back. The transformers engine (``replay.model``, ``replay.decode``) and vLLM's
(``replay.engines.vllm``) take the same three calls, so their verdicts are built one way,
and nothing under ``replay/engines/`` imports ``compare``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from numalign.compare.model_judge import AloneObserver, ModelJudge, Ranks
from numalign.golden.manifest import LOGIT_TRANSFORM

if TYPE_CHECKING:
    from numalign.compare.decode_verdict import DecodeVerdict
    from numalign.compare.judge import CalibratedSet
    from numalign.compare.model_verdict import ModelVerdict, PointResult
    from numalign.core.kernel_scale import KnownScale
    from numalign.core.observation import Event

#: An engine's observation run: hands every event to the judge's ``see``; returns the points
#: (or requests) it has no counterpart for, with the reason (None: none).
Observe = Callable[[Callable[["Event"], None]], "dict[str, str] | None"]

V = TypeVar("V")


@dataclass(frozen=True)
class Judged(Generic[V]):
    """A replay's verdict, and why its failures are expected where a candidate kernel's
    measured scale explains every one (``known``: the evidence; None otherwise)."""

    verdict: V
    known: str | None = None


def judged_layer(
    golden: CalibratedSet, dtype: str, hidden_depth: tuple[int, int], policy: Any,
    observe: Observe, *, known: KnownScale | None = None, leans: bool = True,
) -> Judged[list[PointResult]]:  # fmt: skip
    """A point replayed alone: its results in mode ``isolated`` and (``leans``) its pooled
    leans (``known``: a candidate kernel's measured scale, ``compare.known_scale``)."""
    judge = ModelJudge(golden, dtype, "isolated", hidden_depth, policy, known=known,
                       leans=leans)  # fmt: skip
    observe(judge.see)
    results = judge.layer_results()
    return Judged(results, judge.known_failure())


def judged_model(
    golden: CalibratedSet, dtype: str, hidden_depth: tuple[int, int], policy: Any,
    observe: Observe, alone: AloneObserver, *, leans: bool = True, config: Any = None,
    ranks: Ranks | None = None, known: KnownScale | None = None,
) -> Judged[ModelVerdict]:  # fmt: skip
    """The whole model's verdict in mode ``accumulated``, its first divergence located with
    ``alone`` (where only the logits fail: at the set's logit transform point, named from
    the model's ``config``)."""
    judge = ModelJudge(golden, dtype, "accumulated", hidden_depth, policy, leans=leans,
                       known=known)  # fmt: skip
    unmapped = observe(judge.see)
    verdict = judge.model_verdict(alone, transform=LOGIT_TRANSFORM, config=config,
                                  ranks=ranks, unmapped=unmapped)  # fmt: skip
    return Judged(verdict, judge.known_failure())


def judged_decode(
    golden: CalibratedSet, dtype: str, hidden_depth: tuple[int, int], policy: Any, cache: str,
    observe: Observe, *, leans: bool = True, ranks: Ranks | None = None,
    known: KnownScale | None = None,
) -> Judged[DecodeVerdict]:  # fmt: skip
    """The decode's verdict with KV cache ``cache`` in mode ``decode``."""
    judge = ModelJudge(golden, dtype, "decode", hidden_depth, policy, leans=leans, known=known)
    unmapped = observe(judge.see)
    verdict = judge.decode_verdict(cache, ranks=ranks, unmapped=unmapped)
    return Judged(verdict, judge.known_failure())
