"""numalign's one exception policy (numalign.records.outcomes): what each exception of a test
becomes, its record's fields, and that an exception the policy does not know propagates."""

from __future__ import annotations

from typing import Any

import pytest

from numalign.golden import GoldenSetError
from numalign.records.drift import USER_PROPERTY, DriftRecord, NodeRecorder, records_of
from numalign.records.outcomes import error_property_for, outcome_for, recorded_errors
from numalign.replay.engines.errors import EngineError, EngineUnsupported
from numalign.replay.model import ReplayUnsupported
from numalign.replay.tensor_parallel import RankCrashed, RankFailed, TensorParallelUsageError
from numalign.runtime.compiled import CompileError, CompileStats, KnownCompileError

TEST = "suites/models/test_model.py::test_model[tiny-llama-bfloat16]"
OP = "suites/operators/test_operators.py::test_rms_norm[fused-float16-aligned-4x8]"


def _ended(
    exc: BaseException, test_id: str = TEST, **context: Any
) -> tuple[str, str, list[DriftRecord]]:
    """How a test whose body raised ``exc`` ends (pytest's outcome exception), its message,
    and the records it left."""
    properties: list[tuple[str, object]] = []
    recorder = NodeRecorder(test_id, properties)
    endings = (pytest.fail.Exception, pytest.skip.Exception, pytest.xfail.Exception)
    with pytest.raises(endings) as ended, recorded_errors(recorder, **context):  # type: ignore[arg-type]
        raise exc
    return type(ended.value).__name__, str(ended.value.msg), records_of(properties)  # type: ignore[attr-defined]


def test_broken_golden_data_fails_with_an_error_record_of_what_the_id_tells() -> None:
    ending, message, (record,) = _ended(GoldenSetError("set x: stale; recapture"), swap="tp=2")
    assert (ending, message) == ("Failed", "set x: stale; recapture")
    assert (record.verdict, record.error, record.model, record.dtype) == (
        "error", "GoldenSetError", "tiny-llama", "bfloat16",
    )  # fmt: skip
    assert record.swap is None  # the set is broken whatever the variant


@pytest.mark.parametrize(
    "exc", [ReplayUnsupported("no sdpa here"), EngineUnsupported("no sdpa here")]
)
def test_a_path_the_model_cannot_take_skips_without_a_record(exc: Exception) -> None:
    assert _ended(exc) == ("Skipped", "no sdpa here", [])


def test_a_skip_that_names_a_rule_leaves_a_skipped_record_of_it_with_the_replay_s_fields() -> None:
    """What the reports must count as not judged (an uncalibrated set, a point an engine has
    no counterpart for) leaves a ``skipped`` record of the exception's rule; the fields are
    the guard's (the variant) and the exception's (the engine's replay context)."""
    from numalign.compare.model_verdict import Uncalibrated
    from numalign.core.errors import UNCALIBRATED
    from numalign.replay.decode import DecodeUnavailable
    from numalign.replay.engines import NotJudged

    unmapped = NotJudged("unmapped: no module", {"engine": "vllm", "model": "tiny-mistral"})
    ending, message, (record,) = _ended(unmapped, swap="tp=2")
    assert (ending, message) == ("Skipped", "unmapped: no module")
    assert (record.verdict, record.rule, record.reason) == ("skipped", "skipped", message)
    assert (record.engine, record.model, record.swap) == ("vllm", "tiny-mistral", "tp=2")
    ending, _, (record,) = _ended(Uncalibrated("captured with --calibrate ''\nsecond line"))
    assert (ending, record.rule, record.reason) == ("Skipped", UNCALIBRATED, "captured with "
                                                    "--calibrate ''")  # fmt: skip
    # a set without decode steps is nothing to count: a skip, no record
    assert _ended(DecodeUnavailable("tiny-bert has no decode steps"))[2] == []


def test_a_compiler_failure_is_an_error_record_with_what_compiling_cost() -> None:
    spent = CompileStats(compile_s=1.25, graph_breaks=2)
    ending, message, (record,) = _ended(
        CompileError("inductor: boom", spent=spent), OP, point="rms_norm", swap="compile=inductor"
    )
    assert (ending, message) == ("Failed", "inductor: boom")
    assert (record.verdict, record.error, record.point, record.swap) == (
        "error", "CompileError", "rms_norm", "compile=inductor",
    )  # fmt: skip
    assert (record.compile_s, record.graph_breaks, record.candidate, record.case) == (
        1.25, 2, "fused", "aligned-4x8",
    )  # fmt: skip


def test_a_known_compiler_bug_is_an_expected_failure_its_record_kept() -> None:
    ending, message, (record,) = _ended(KnownCompileError("inductor: boom", known="issue 123"))
    assert ending == "XFailed" and message == "known compiler bug: issue 123\ninductor: boom"
    assert record.verdict == "error"


def test_ranks_and_engines_that_died_are_crashed_those_that_raised_errors() -> None:
    ending, _, (crashed,) = _ended(RankCrashed("rank 1 died\nexit code -9"), swap="tp=2")
    assert ending == "Failed"
    assert (crashed.verdict, crashed.reason, crashed.message, crashed.swap) == (
        "crashed", "rank 1 died", "rank 1 died\nexit code -9", "tp=2",
    )  # fmt: skip
    assert _ended(EngineError("hung", crashed=True))[2][0].verdict == "crashed"
    for exc in (
        RankFailed("rank 0 raised"),
        EngineError("no start"),
        TensorParallelUsageError("9 heads"),
    ):
        ending, message, (record,) = _ended(exc, swap="tp=2")
        assert (ending, message, record.verdict, record.swap) == (
            "Failed",
            str(exc),
            "error",
            "tp=2",
        )
        assert record.error == type(exc).__name__


def test_an_exception_the_policy_does_not_know_propagates_unchanged() -> None:
    assert outcome_for(RuntimeError("kernel launch failed"), TEST) is None
    properties: list[tuple[str, object]] = []
    recorder = NodeRecorder(TEST, properties)
    with pytest.raises(RuntimeError, match="kernel launch failed"), recorded_errors(recorder):
        raise RuntimeError("kernel launch failed")
    assert properties == []


def test_the_report_hook_records_a_raise_with_its_traceback_and_trusts_a_judged_failure() -> None:
    with pytest.raises(RuntimeError) as raised:
        raise RuntimeError("kernel launch failed")
    name, value = error_property_for(OP, raised, [], device="cpu")  # type: ignore[misc]
    record = DriftRecord.from_dict(value)  # type: ignore[arg-type]
    assert name == USER_PROPERTY and (record.verdict, record.error, record.device) == (
        "error", "RuntimeError", "cpu",
    )  # fmt: skip
    assert record.message is not None and "RuntimeError: kernel launch failed" in record.message
    assert "raise RuntimeError" in record.message  # where it raised
    recorded = [(USER_PROPERTY, DriftRecord(test_id=OP, verdict="failed").to_dict())]
    with pytest.raises(pytest.fail.Exception) as failed:
        pytest.fail("budget exceeded")
    assert error_property_for(OP, failed, recorded) is None  # its records tell the failure
    _, value = error_property_for(OP, failed, [])  # type: ignore[misc]
    assert DriftRecord.from_dict(value).message == "budget exceeded"  # type: ignore[arg-type]
    assert error_property_for(OP, None, []) is None


def _numalign_exceptions() -> list[type[BaseException]]:
    """Every exception class defined in numalign's modules (imported: torch-free ones and
    those the test environment can import)."""
    import importlib
    import inspect
    import pkgutil

    import numalign

    found = []
    for info in pkgutil.walk_packages(numalign.__path__, "numalign."):
        if info.name.startswith(("numalign.replay.engines.vllm", "numalign.plugin")):
            continue  # vLLM itself is not installed here; the plugin registers hooks
        if info.name.endswith(".__main__"):
            continue  # running the command line is what importing a __main__ does
        if info.name == "numalign.sweep.planted":
            # importing it registers planted norms as candidates, which every later test in
            # this worker would then run as honest ones (tests/operators/test_reseeded.py)
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and issubclass(cls, BaseException):
                found.append(cls)
    return found


def test_every_exception_numalign_defines_is_one_of_the_five_kinds() -> None:
    from numalign.core import errors

    kinds = (errors.Unsupported, errors.BrokenData, errors.Crashed, errors.KnownDivergence,
             errors.UsageError)  # fmt: skip
    exceptions = [c for c in _numalign_exceptions() if not issubclass(c, Warning)]
    assert len(exceptions) > 25  # the walk reached the packages' modules
    strays = [c.__qualname__ for c in exceptions
              if c.__module__ != "numalign.core.errors" and not issubclass(c, kinds)]  # fmt: skip
    assert strays == []


def test_each_kind_ends_the_test_its_own_way() -> None:
    from numalign.core import errors

    ending, _, records = _ended(errors.Unsupported("no SDPA path"))
    assert (ending, records) == ("Skipped", [])
    ending, _, (record,) = _ended(errors.BrokenData("shard 2 truncated"))
    assert (ending, record.verdict) == ("Failed", "error")
    ending, _, (record,) = _ended(errors.UsageError("--tp 3: 8 heads do not split"))
    assert (ending, record.verdict, record.error) == ("Failed", "error", "UsageError")
    ending, _, (record,) = _ended(errors.Crashed("member low exited 1"))
    assert (ending, record.verdict) == ("Failed", "error")
