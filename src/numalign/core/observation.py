"""What an engine hands the judge: the data between the two, and nothing of either.

An engine (``replay``) runs the model and hands each thing it computed to the judge
(``compare.model_judge.ModelJudge.see``) as one of these: an :class:`Observation` (one output
of one call of a capture point), a :class:`FinalOutput` (the model's own logits or hidden
states), a :class:`ContinuationRun` (how to run the greedy continuation). Engines import
these and no rule of ``compare``; :func:`label` is how messages and records name a point's
output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from numalign.core.statistics import TensorStatistics


def label(point: str, path: str) -> str:
    """A point's output as messages and records name it: ``model.layers.0`` for a plain
    tensor output, ``model.layers.0.self_attn.0`` for an output inside a tuple."""
    return point if path == "0" else f"{point}.{path}"


@dataclass(frozen=True)
class Observation:
    """One output of one call of a capture point as an engine computed it (``actual``, whole:
    a tensor-parallel rank's shard gathered, the positions a request's mask keeps) beside the
    golden one (``expected``, the same positions). ``finished``: when the call completed in
    the engine's forward (children before their parents; the judge's own count where None);
    ``step``: the decode step (0: the prefill's cache); ``left_out``: faults in the rows the
    comparison leaves out (padding), which fail the point that produced them; ``control_of``:
    the point output whose control judges this one where it has none of its own (a fused
    add + norm's residual stream: the stream's error where it enters the norm)."""

    point: str
    path: str
    request: str
    actual: torch.Tensor
    #: the golden tensor, or its statistics where the set keeps only those
    expected: torch.Tensor | TensorStatistics
    call: int = 0
    step: int | None = None
    finished: int | None = None
    #: ``compare.exact.LeftOut``, or None
    left_out: Any = None
    control_of: tuple[str, str] | None = None


@dataclass(frozen=True)
class FinalOutput:
    """One of the model's own outputs for ``request`` (``output``: ``logits``, or an
    encoder's hidden states by name) as the engine computed it, in the replay's dtype and
    whole, beside the golden one (both at the positions the request's mask keeps)."""

    request: str
    output: str
    actual: torch.Tensor
    expected: torch.Tensor


@dataclass(frozen=True)
class ContinuationRun:
    """The golden greedy continuation of ``request`` (``tokens`` [rows, steps], the golden
    ``logits`` [rows, steps, vocab] at each step) and ``steps``: runs it on the engine,
    yielding each step's last-position logits [rows, vocab] with the golden token of every
    earlier step fed (teacher-forced, so every step compares like with like). The judge runs
    it only where the prompt's logits have a budget to judge it by."""

    request: str
    tokens: torch.Tensor
    logits: torch.Tensor
    steps: Callable[[], Iterable[torch.Tensor]]


#: What an engine hands the judge.
Event = Observation | FinalOutput | ContinuationRun
