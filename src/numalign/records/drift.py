"""Drift records: one typed record per comparison, collected on the xdist controller.

Tests hand records to pytest as user properties (key ``numalign.drift``, the record's JSON
dict), so they travel to the controller with each test report. The controller appends them to
``<report-dir>/<run-id>/records.jsonl`` as reports arrive, flushed, so a crashed worker or a
killed session still leaves every record received so far. A test whose worker crashed gets a
record with verdict "crashed"; a test that raised gets one with verdict "error". Both keep what
the test id tells of the test (suite, operator or point, candidate, dtype, case).

Every reader (tables, baseline diff, merge, history, Allure, drift.html) takes
:class:`DriftRecord`; :func:`read_records` reads schema versions 1 to 6. A non-finite number
is written as a string (``numalign.core.finite_json``) and read back as its float: a NaN metric is
a finding, never a record lost or a session aborted.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import IO, Any

from numalign.compare import CompareResult
from numalign.core import finite_json
from numalign.records.testids import parse as parse_test_id

#: Version of the record schema; bump it when a field changes meaning or goes away.
#: 2: request, output, step and error fields; the key holds request, output and step;
#: verdict "error". 3: the execution variant as structured fields (engine, attention,
#: experts, swaps, compile_backend, compile_mode, tp, cache, engine_variant), ``swap``
#: still holding its label; keys unchanged. 4: a non-finite number is the string "NaN",
#: "Infinity" or "-Infinity" (``finite_json``; null in earlier schemas); rule
#: ``uncalibrated`` for a test skipped for want of calibration. 5: ``detectable``, the
#: verdict's power (``compare.power``: the smallest scale and bias its rules would have
#: caught; absent, read as None, before). 6: ``cause``, a failure's likely cause
#: (``compare.cause``: label, evidence, confidence; absent, read as None, before).
SCHEMA_VERSION = 6
USER_PROPERTY = "numalign.drift"
#: Lines of the traceback an error record keeps (where the exception came from).
TRACEBACK_LINES = 20
#: Verdicts, from best to worst (a test's outcome is its worst record's).
VERDICTS: tuple[str, ...] = ("skipped", "passed", "crashed", "error", "failed")
#: Outcomes of a test as pytest counts them (its terminal's last line), in the order reports
#: show them, and ``crashed``: a test whose worker died (pytest counts it among the failed).
OUTCOMES: tuple[str, ...] = (
    "failed", "error", "crashed", "xpassed", "xfailed", "skipped", "passed",
)  # fmt: skip
#: What a record shows, worst first: its verdict, or xfailed and xpassed where its test was
#: an expected failure (a failing record of an xfailed test is expected, never "failed").
STATUSES: tuple[str, ...] = OUTCOMES
#: Statuses that are failures a reviewer must read (xfailed is expected, not one of them).
FAILING: tuple[str, ...] = ("failed", "error", "crashed", "xpassed")
#: Model-suite modes that judge the model's end result rather than a capture point.
END_MODES = ("logits", "continuation", "output")
#: Fields that hold numbers (or, in ``metrics`` and ``budget``, dicts of them): read back
#: through ``finite_json.decode``.
_NUMBERS = (
    "metrics", "budget", "budget_used", "duration_s", "compile_s", "detectable", "cause",
)  # fmt: skip


@dataclass
class DriftRecord:
    """One comparison of one test: what was compared, where, in what, and the verdict.

    ``point`` is the operator (or operator output) or the capture point (with its output path);
    ``case`` the operator case or, in the model suites, the golden request; ``swap`` names the
    execution variant (swapped kernels, attention or experts implementation, the compiled
    backend as ``compile=BACKEND[:MODE]``, decode's cache as ``cache=NAME``: the label of
    ``runtime.variant.Variant``), and from schema 3 the variant's fields say it again, one
    field each (None in older records: read ``swap`` there). Model suites fill
    ``model``, ``mode`` (isolated, accumulated, logits, continuation, output, decode),
    ``request``, ``output`` and ``step`` (decode: 1 for the first step, 0 for the prefill's
    cache).
    """

    test_id: str
    suite: str | None = None
    point: str | None = None
    candidate: str | None = None
    device: str | None = None
    dtype: str | None = None
    case: str | None = None
    shape: list[int] | None = None
    verdict: str = "passed"
    rule: str | None = None
    reason: str | None = None
    budget_used: float | None = None
    duration_s: float | None = None
    golden_fingerprint: str | None = None
    swap: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    budget: dict[str, Any] = field(default_factory=dict)
    message: str | None = None
    model: str | None = None
    mode: str | None = None
    request: str | None = None
    output: str | None = None
    step: int | None = None
    #: which call of the point in its request (0: the first; a module called twice in one
    #: forward, a shared block or a weight-tied layer, has one record per call)
    call: int | None = None
    point_index: int | None = None
    first_divergence: dict[str, Any] | None = None
    error: str | None = None
    #: Seconds this test spent compiling (``--compile``; the rest of ``duration_s`` ran the
    #: compiled code; 0 where the compiled artifact was reused); None: eager.
    compile_s: float | None = None
    #: Graph breaks Dynamo made while compiling for this test (``--compile``).
    graph_breaks: int | None = None
    #: The test's outcome as pytest counts it (one of OUTCOMES), set by the controller when
    #: the record arrives; None in records written before it (their verdict stands).
    outcome: str | None = None
    #: Why the test was expected to fail (``pytest.mark.xfail(reason=...)``, ``pytest.xfail``),
    #: where it was.
    xfail_reason: str | None = None
    # -- the execution variant (schema 3; ``runtime.variant.Variant.record_fields``) -------
    #: What replayed the model (transformers, vllm); None in the operator suite.
    engine: str | None = None
    #: The engine's own account of what it ran (vLLM: version, attention backend, graph).
    engine_variant: str | None = None
    #: Attention and experts implementations asked for (None: the model's own).
    attention: str | None = None
    experts: str | None = None
    #: Kernel swaps (``--swap`` specs, ``OPERATOR=CANDIDATE``), in order.
    swaps: list[str] | None = None
    #: ``torch.compile`` backend and mode (``--compile``, ``--compile-mode``); None: eager.
    compile_backend: str | None = None
    compile_mode: str | None = None
    #: Tensor-parallel ranks (1: one process).
    tp: int | None = None
    #: The decode's KV cache (``--cache-implementation``); None outside decode.
    cache: str | None = None
    #: The verdict's power (schema 5, ``compare.power``): the smallest relative scale
    #: (``scale``) and additive bias in units of the truth's RMS (``bias``) its rules would
    #: have caught, of either sign (infinite: none would); None where the output is judged
    #: exactly (integers, selections, masks, rounding) or there was no comparison.
    detectable: dict[str, float] | None = None
    #: A failure's likely cause (schema 6, ``compare.cause``): ``label`` (scale, offset,
    #: epsilon, position, mask, precision, clamp, nonfinite, routing or unknown),
    #: ``evidence`` (one line, with the numbers) and ``confidence`` in [0, 1]; None for a
    #: pass, a record without a comparison, and records before schema 6.
    cause: dict[str, Any] | None = None
    schema: int = SCHEMA_VERSION

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_result(cls, result: CompareResult, *, test_id: str, **context: Any) -> DriftRecord:
        """The record of one comparison (JSON-ready: non-finite numbers become null)."""
        data = result.to_dict()
        return cls(
            test_id=test_id,
            point=result.name,
            dtype=result.dtype,
            shape=data["shape"],
            verdict="passed" if result.passed else "failed",
            rule=result.rule,
            reason=result.reason,
            budget_used=data["budget_used"],
            metrics=data["metrics"],
            budget=data["budget"],
            message=None if result.passed else result.message(),
            detectable=result.detectable.to_dict() if result.detectable else None,
            cause=data["cause"],
            **context,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DriftRecord:
        """A record read back from JSON, schema 1 to 6. Schema 1 records named the golden
        request only in ``case``; it becomes ``request`` for model records. Records before
        schema 3 keep their variant in ``swap`` alone (its fields stay None); a record keeps
        the schema it was written in (one without the field is schema 1)."""
        known = {f.name for f in fields(cls)}
        values = {k: finite_json.decode(v) if k in _NUMBERS else v
                  for k, v in data.items() if k in known}  # fmt: skip
        values["metrics"] = values.get("metrics") or {}
        values["budget"] = values.get("budget") or {}
        values["schema"] = schema = int(data.get("schema") or 1)
        if schema < 2 and data.get("suite") == "models":
            values.setdefault("request", data.get("case"))
        values.setdefault("test_id", "")
        return cls(**values)

    @classmethod
    def for_test(cls, test_id: str, verdict: str, **context: Any) -> DriftRecord:
        """A record with no comparison behind it (skipped, error, crashed), holding what the
        test id tells of the test."""
        return cls(test_id=test_id, verdict=verdict, **(context_from_test_id(test_id) | context))

    def to_dict(self) -> dict[str, Any]:
        """The record's fields, numbers as they are (NaN included), dicts and lists copied."""
        return {name: _copied(getattr(self, name)) for name in _FIELD_NAMES}

    def to_json(self) -> dict[str, Any]:
        """The record's fields, JSON-ready: non-finite numbers as ``finite_json`` writes
        them (``from_dict`` reads them back)."""
        data: dict[str, Any] = finite_json.encode({n: getattr(self, n) for n in _FIELD_NAMES})
        return data

    def with_fields(self, **changes: Any) -> DriftRecord:
        return replace(self, **changes)

    # -- identity -----------------------------------------------------------------------------
    @property
    def key(self) -> str:
        """Everything that tells two records of one test apart: test id, point, request,
        output path, decode step and the point's call after its first. Unique within a run;
        matches records across runs (a first call's key carries no call number, so it
        matches a baseline whose records do not count calls)."""
        parts = [self.test_id, self.point or "", self.request or "", self.output or ""]
        if self.step is not None:
            parts.append(f"step{self.step}")
        if self.call:
            parts.append(f"call{self.call}")
        return "::".join(parts)

    @property
    def used(self) -> float | None:
        """The use of budget, where the record has one; a NaN use (an error that could not be
        measured) is infinite: beyond any budget, the worst when records are ranked."""
        value = self.budget_used
        if not isinstance(value, (int, float)):
            return None
        return math.inf if math.isnan(value) else float(value)

    @property
    def status(self) -> str:
        """What reports show and count for this record: its verdict, except in a test pytest
        counted as an expected failure (a failing record is then ``xfailed``) or as an
        unexpected pass (``xpassed``)."""
        if self.outcome == "xfailed" and self.verdict in ("failed", "error", "crashed"):
            return "xfailed"
        if self.outcome == "xpassed" and self.verdict == "passed":
            return "xpassed"
        return self.verdict

    @property
    def test_dtype(self) -> str | None:
        """The dtype the test ran in (from its id), else the record's own (an operator's
        integer output records int64, its test ran in bfloat16)."""
        return context_from_test_id(self.test_id).get("dtype") or self.dtype

    @property
    def group(self) -> str:
        """What a trend line follows: the operator; for model suites the model set, with its
        logits, continuation and final outputs followed apart from its points."""
        if self.model:
            return f"{self.model} {self.mode}" if self.mode in END_MODES else self.model
        return (self.point or "?").split(".")[0]


#: DriftRecord's fields, in order (what to_dict and to_json write).
_FIELD_NAMES = tuple(f.name for f in fields(DriftRecord))


def _copied(value: Any) -> Any:
    """``value`` with its dicts and lists copied (all a record's fields hold besides scalars:
    ``dataclasses.asdict``'s generic deep copy would cost many times more)."""
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    return [_copied(item) for item in value] if isinstance(value, list) else value


#: The mode of a model-suite test's records, by its test function.
_MODES = {"test_layer": "isolated", "test_model": "accumulated", "test_decode": "decode"}


def context_from_test_id(test_id: str) -> dict[str, Any]:
    """What a numalign suite's test id says of its test (``numalign.records.testids``), as record
    fields, for records written without a comparison (a test that raised, a worker that
    crashed). Other ids give what they can (nothing, for a test outside the suites)."""
    parsed = parse_test_id(test_id)
    context: dict[str, Any] = {"suite": parsed.suite}
    if parsed.dtype is None:
        return context
    context["dtype"] = parsed.dtype
    if parsed.suite == "models":
        context |= {"model": parsed.model, "candidate": "transformers", "point": parsed.point,
                    "mode": _MODES.get(parsed.function)}  # fmt: skip
    else:
        context |= {"candidate": parsed.candidate, "case": parsed.case, "point": parsed.operator}
    return context


def outcome_of(records: Iterable[DriftRecord]) -> dict[str, str]:
    """Per test id, its outcome: the one pytest gave it where the records carry it, else its
    worst record's verdict (failed over error over crashed over passed over skipped)."""
    rank = {v: i for i, v in enumerate(VERDICTS)}
    out: dict[str, str] = {}
    told: dict[str, str] = {}
    for r in records:
        if r.outcome in OUTCOMES:
            told[r.test_id] = r.outcome
        if rank.get(r.verdict, 0) >= rank.get(out.get(r.test_id, "skipped"), 0):
            out[r.test_id] = r.verdict
    return out | told


def pytest_outcome(report: Any) -> str | None:
    """How pytest counts one test report (its terminal summary's categories): ``passed``,
    ``failed``, ``skipped``, ``xfailed``, ``xpassed`` for the call; ``error`` for a setup or
    teardown that failed, ``skipped`` for a setup that skipped; None for a setup or teardown
    that passed (pytest does not count it). A report of a crashed xdist worker is
    ``crashed``."""
    when = str(getattr(report, "when", ""))
    if when == "???":
        return "crashed"
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed" if report.passed else "failed"
    if when in ("setup", "teardown"):
        return "error" if report.failed else "skipped" if report.skipped else None
    return str(report.outcome)


def count_outcomes(outcomes: Iterable[str]) -> dict[str, int]:
    """Counts per outcome, in OUTCOMES' order, the ones seen only."""
    seen = list(outcomes)
    return {o: seen.count(o) for o in OUTCOMES if o in seen}


@dataclass
class RecordWriter:
    """Appends records to a JSON-lines file, one flushed line per record; the file (and its
    folder) appear with the first record."""

    path: Path
    count: int = 0
    _fh: IO[str] | None = None

    def open(self) -> RecordWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")
        return self

    def write(self, record: DriftRecord) -> None:
        if self._fh is None:
            self.open()
        assert self._fh is not None
        self._fh.write(json.dumps(record.to_json(), allow_nan=False) + "\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None


def write_records(path: Path, records: Iterable[DriftRecord]) -> Path:
    """Writes a whole records.jsonl atomically (a partial file never replaces a whole one)."""
    tmp = path.with_suffix(".jsonl.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            for record in records:
                fh.write(json.dumps(record.to_json(), allow_nan=False) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no torn temporary file behind
        raise
    return path


def read_records(path: str | Path, *, whole: bool = False) -> list[DriftRecord]:
    """Records of a run folder or a records.jsonl file (schema 1 to 6). A last line cut by a
    crash is skipped; any other unreadable line is an error naming the file and line. With
    ``whole`` (a baseline: what it lacks would pass as "new" records, never as regressions),
    a cut last line and a file without a record are errors too, naming the file."""
    file = Path(path)
    if file.is_dir():
        file = file / "records.jsonl"
    if not file.is_file():
        raise FileNotFoundError(
            f"no records at {path}: expected a run folder holding records.jsonl, or the file"
        )
    records = list(_parse(file, file.read_text(encoding="utf-8").splitlines(), whole))
    if whole and not records:
        raise ValueError(
            f"{file}: holds no record (empty: its run wrote nothing, or the file was "
            "truncated); a baseline must read whole: re-run its session, or point at the "
            "right run's records"
        )
    return records


def _parse(file: Path, lines: list[str], whole: bool = False) -> Iterator[DriftRecord]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and not whole:  # being written when the session died
                return
            if not whole or number < len(lines):
                raise ValueError(f"{file}:{number}: not a JSON record ({exc})") from None
            raise ValueError(
                f"{file}:{number}: a record cut mid-line (the file is torn: {exc}); a baseline "
                "must read whole: re-run its session, or point at the right run's records"
            ) from None
        if not isinstance(data, dict) or int(data.get("schema") or 1) > SCHEMA_VERSION:
            raise ValueError(
                f"{file}:{number}: not a drift record of schema 1 to {SCHEMA_VERSION}; a newer "
                "numalign wrote it: upgrade numalign to read it"
            )
        yield DriftRecord.from_dict(data)


def new_run_id(now: float | None = None) -> str:
    """A sortable run id: UTC time to the second, the process id and 48 random bits (process
    ids repeat across containers and machines writing one report folder; two shards started
    in the same second must not share a run)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    return f"{stamp}-{os.getpid()}-{secrets.token_hex(6)}"


class NodeRecorder:
    """Hands records of one test to pytest as user properties (the ``record_drift``
    fixture): ``record_drift(result, suite=..., candidate=..., device=..., case=...)``, or
    ``record_drift.add(record)`` for a record built by the library (logits, continuation)."""

    def __init__(
        self,
        nodeid: str,
        user_properties: list[tuple[str, object]],
        on_record: Callable[[DriftRecord], None] | None = None,
    ) -> None:
        self.nodeid = nodeid
        self.user_properties = user_properties
        self.on_record = on_record

    def __call__(self, result: CompareResult, **context: Any) -> DriftRecord:
        return self.add(DriftRecord.from_result(result, test_id=self.nodeid, **context))

    def add(self, record: DriftRecord) -> DriftRecord:
        self.user_properties.append((USER_PROPERTY, record.to_json()))
        if self.on_record is not None:
            self.on_record(record)
        return record

    def error(self, exc: BaseException, **context: Any) -> DriftRecord:
        """Records an exception that ends the test before (or instead of) its comparisons."""
        return self.add(error_record(self.nodeid, type(exc).__name__, str(exc), **context))

    def crashed(self, reason: str, message: str, **context: Any) -> DriftRecord:
        """Records a test whose processes died or hung (a tensor-parallel rank)."""
        return self.add(crashed_record(self.nodeid, message, reason[:500], **context))

    def skipped(self, reason: str, **context: Any) -> DriftRecord:
        """Records a comparison that cannot run here (so summaries count it per dtype)."""
        record = DriftRecord.for_test(
            self.nodeid, "skipped", rule="skipped", reason=reason, **context
        )
        return self.add(record)


def records_of(user_properties: Iterable[tuple[str, object]]) -> list[DriftRecord]:
    """The drift records among a test report's user properties."""
    return [
        DriftRecord.from_dict(value)
        for name, value in user_properties
        if name == USER_PROPERTY and isinstance(value, dict)
    ]


def error_record(test_id: str, exc_type: str, message: str, **context: Any) -> DriftRecord:
    """The record of a test that raised (a candidate, a model or a replay that broke):
    verdict ``error``, the exception's type and message."""
    return DriftRecord.for_test(
        test_id, "error", rule="error", error=exc_type,
        reason=f"{exc_type}: {message.splitlines()[0] if message else ''}"[:500],
        message=message, **context,
    )  # fmt: skip


def crashed_record(
    test_id: str,
    message: str,
    reason: str = "the worker process died while running this test",
    **context: Any,
) -> DriftRecord:
    """The record of a test whose worker (or one of its tensor-parallel ranks) died or hung
    while running it."""
    return DriftRecord.for_test(
        test_id, "crashed", rule="crashed", reason=reason, message=message, **context
    )
