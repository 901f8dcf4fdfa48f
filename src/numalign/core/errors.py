"""numalign's exceptions: five kinds, one base. Every exception numalign raises on purpose is
one of them, so that what a test becomes (``records.outcomes.outcome_for``) and what the command
line prints follow from the kind, never from a module's own class list or a message's text.

- :class:`Unsupported`: a path this model, engine or device cannot take here (transformers
  lacks an implementation, vLLM does not serve the model, a module cannot run alone, no
  tensor-parallel plan, a set without decode steps). The test is skipped with the reason;
  nothing is wrong. Where the reports must count the skip (its ``rule``), it leaves a
  ``skipped`` record.
- :class:`BrokenData`: a golden set, checkpoint or model folder that is missing, stale,
  corrupted or not what it claims. The test fails with a message that says how to fix it;
  the data is never half-written.
- :class:`Crashed`: what numalign drove failed under it (a serving engine, a tensor-parallel
  rank, a compiler, a calibration member's process); ``crashed``: it died or hung rather
  than raised. The test fails with an ``error`` (or ``crashed``) record; the session goes on.
- :class:`KnownDivergence`: a failure numalign recognises as a known defect outside the
  candidate (an upstream compiler bug): an expected failure, its record kept.
- :class:`UsageError`: options or inputs that cannot work together (an unknown operator or
  dtype, a swap no model can take, ``--tp`` on a model that does not split). The message
  names the option to change.

Each class keeps the built-in base it had (``ValueError``, ``RuntimeError``, ``LookupError``)
beside its kind, so code that caught those still does.
"""

from __future__ import annotations

from typing import Any


class NumalignError(Exception):
    """The base of every exception numalign raises on purpose."""

    def record_fields(self) -> dict[str, Any]:
        """Fields the test's record carries besides the test's own (what compiling cost, say)."""
        return {}


#: The rule of the record a replay skipped for want of calibration leaves (the reports count
#: such tests as not judged, never as passed).
UNCALIBRATED = "uncalibrated"


class Unsupported(NumalignError):
    """A path that cannot be taken here: the test skips with the reason. A subclass that sets
    ``rule`` also leaves a ``skipped`` record of that rule (with ``record_fields``), where the
    reports must count what was not judged (an uncalibrated set, a point an engine has no
    counterpart for)."""

    rule: str | None = None


class BrokenData(NumalignError):
    """Missing, stale or corrupted data: the test fails with how to fix it."""


class Crashed(NumalignError):
    """What numalign drove failed under it; ``crashed``: it died or hung (no answer)."""

    crashed: bool = False


class KnownDivergence(NumalignError):
    """A failure recognised as a known defect outside the candidate: an expected failure,
    ``known`` saying which defect, ``defect`` what kind of defect it is."""

    known: str | None = None
    defect: str = "defect"


class UsageError(NumalignError):
    """Options or inputs that cannot work together: the message names what to change."""
