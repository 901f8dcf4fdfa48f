"""What an exception of a test becomes: the one policy, for every suite and the plugin.

A test runs its body in :func:`recorded_errors`; an exception the policy knows ends the test
as :func:`outcome_for` says, with its record:

- broken, stale or corrupted golden data (``BrokenData``): an ``error`` record holding
  what the test id tells (the set is broken whatever the variant) and a failure with the
  set's own message (it says how to fix it);
- a path this model cannot take here (``Unsupported``: transformers lacks it, the serving
  engine does not support the model, no tensor-parallel plan, ...): a skip with its reason,
  no record; where the exception names a ``rule`` (a golden set without calibration of a
  point in the dtype, ``Uncalibrated``, rule ``uncalibrated``; a point an engine has no
  counterpart for, ``NotJudged``), a ``skipped`` record of that rule as well, so that the
  reports can tell a run that judged little from a pass;
- a known defect outside the candidate (``KnownDivergence``: an upstream compiler bug under
  ``--compile``): an expected failure (xfail), its ``error`` record kept;
- what numalign drove failing under it (``Crashed``: a compiler, a tensor-parallel rank, the
  serving engine, a calibration member): an ``error`` record with the test's fields (and
  what compiling cost), or ``crashed`` when it died or hung (the session goes on: the next
  test starts afresh), and a failure;
- options or inputs that cannot work together (``UsageError``: a model that does not split
  over ``--tp`` ranks, say): an ``error`` record and a failure.

The policy dispatches on the kinds of ``numalign.core.errors``, never on a module's classes. Any
other exception propagates: pytest reports it, and the plugin's report hook gives the
test an ``error`` record with the exception's type, message and the last lines of its
traceback (:func:`error_property_for`), unless the test's own records already tell its
failure (``pytest.fail`` or an assertion after recording).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from numalign.core.errors import BrokenData, Crashed, KnownDivergence, NumalignError, Unsupported
from numalign.records.drift import (
    TRACEBACK_LINES,
    USER_PROPERTY,
    DriftRecord,
    crashed_record,
    error_record,
    records_of,
)

if TYPE_CHECKING:
    from numalign.records.drift import NodeRecorder

#: How a test that raised ends.
ENDINGS: tuple[str, ...] = ("fail", "skip", "xfail")


@dataclass(frozen=True)
class ErrorOutcome:
    """What one exception of a test becomes: how the test ends (one of ENDINGS), the message
    pytest shows, and the record it leaves (None: none, a skip)."""

    ending: str
    message: str
    record: DriftRecord | None = None

    def apply(self, recorder: NodeRecorder) -> NoReturn:
        """Records ``record`` through the test's recorder, then ends the test."""
        __tracebackhide__ = True
        if self.record is not None:
            recorder.add(self.record)
        if self.ending == "skip":
            pytest.skip(self.message)
        if self.ending == "xfail":
            pytest.xfail(self.message)
        pytest.fail(self.message, pytrace=False)


def outcome_for(exc: BaseException, test_id: str, **context: Any) -> ErrorOutcome | None:
    """The outcome of ``exc``, raised by the test ``test_id`` (see the module's docstring);
    ``context``: the fields its record carries besides what the test id tells (the
    candidate, device, case, execution variant). None: an exception the policy leaves to
    pytest and the plugin's report hook."""
    text = str(exc)
    kind = type(exc).__name__
    if not isinstance(exc, NumalignError):
        return None
    if isinstance(exc, BrokenData):  # the set is broken whatever the variant
        return ErrorOutcome("fail", text, error_record(test_id, kind, text))
    fields = context | exc.record_fields()
    if isinstance(exc, Unsupported):
        if exc.rule is None:
            return ErrorOutcome("skip", text)
        # not judged, and the reports count it apart (an uncalibrated set, an unmapped point)
        reason = (text.splitlines() or [""])[0][:500]
        record = DriftRecord.for_test(test_id, "skipped", rule=exc.rule, reason=reason, **fields)
        return ErrorOutcome("skip", text, record)
    if isinstance(exc, KnownDivergence):  # a known defect outside the candidate: recorded
        record = error_record(test_id, kind, text, **fields)
        return ErrorOutcome("xfail", f"known {exc.defect}: {exc.known}\n{exc}", record)
    if isinstance(exc, Crashed) and exc.crashed:  # died or hung: the session goes on
        reason = (text.splitlines() or [""])[0][:500]
        return ErrorOutcome("fail", text, crashed_record(test_id, text, reason, **fields))
    # crashed under the test (raised), or a usage error: an error record and a failure
    return ErrorOutcome("fail", text, error_record(test_id, kind, text, **fields))


def failed_verdict(message: str, known: str | None = None) -> NoReturn:
    """Ends a test whose verdict failed (its records already kept): an expected failure
    where the engine measured a known defect that explains every failure (``known``: the
    engine's reason, ``Replayed.known``), a failure showing ``message`` otherwise."""
    __tracebackhide__ = True
    if known:
        pytest.xfail(f"known divergence: {known}\n{message}")
    pytest.fail(message, pytrace=False)


@contextmanager
def recorded_errors(recorder: NodeRecorder, **context: Any) -> Iterator[None]:
    """Runs a test's body under the policy: an exception it knows ends the test as
    :func:`outcome_for` says, recorded through ``recorder`` with ``context``; any other
    propagates unchanged."""
    __tracebackhide__ = True
    try:
        yield
    except Exception as exc:
        outcome = outcome_for(exc, recorder.nodeid, **context)
        if outcome is None:
            raise
        outcome.apply(recorder)


def error_property_for(
    test_id: str,
    excinfo: Any,
    user_properties: list[tuple[str, object]],
    **context: Any,
) -> tuple[str, dict[str, Any]] | None:
    """The user property that records a failed test's error (the plugin's report hook), or
    None where its records already tell the failure: a test that failed its comparisons
    (``pytest.fail`` or an assertion after recording) has its records; an exception of any
    other type, or a failure that left no record, becomes an ``error`` record, with the last
    lines of the short traceback for an exception other than the test's own verdict."""
    recorded = records_of(user_properties)
    if excinfo is None:
        return None
    exc = excinfo.value
    kind = type(exc).__name__
    judged = isinstance(exc, (pytest.fail.Exception, AssertionError))  # the test's verdict
    if judged and recorded:
        return None
    message = str(exc) if judged else f"{kind}: {exc}"
    if not judged:  # where it raised: the last lines of the short traceback
        lines = str(excinfo.getrepr(style="short")).splitlines()
        message += "\n\n" + "\n".join(lines[-TRACEBACK_LINES:])
    record = error_record(test_id, kind, message, **context)
    return (USER_PROPERTY, record.to_json())
