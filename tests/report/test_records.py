"""Records travel from xdist workers to the controller; none is lost when a worker dies."""

from __future__ import annotations

import json

import pytest

from numalign.records.drift import DriftRecord, read_records

COMPARISONS = """
import os
import pytest
import torch
from numalign.compare import CompareSpec, compare

@pytest.mark.parametrize("i", range(200))
def test_compare(i, record_drift):
    if i == {kill} and os.environ.get("KILL_ONE"):
        os._exit(3)  # the worker dies in the middle of the run
    t = torch.full((8,), float(i), dtype=torch.float64)
    result = compare(t.float(), t, CompareSpec(name=f"point{{i}}"))
    record_drift(result, suite="operators", candidate="c", device="cpu", case=str(i))
    assert result.passed
"""


def _run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, list[DriftRecord]]:
    pytester.makepyfile(COMPARISONS.format(kill=77))
    result = pytester.runpytest_subprocess(
        "-n", "2", "--report-dir", "out", "-p", "no:cacheprovider", *args
    )
    return result, read_records(pytester.path / "out" / "latest")


def test_two_hundred_comparisons_give_two_hundred_records(pytester: pytest.Pytester) -> None:
    result, records = _run(pytester)
    result.assert_outcomes(passed=200)
    assert len(records) == 200
    assert sorted(int(r.case) for r in records) == list(range(200))
    summary = json.loads((pytester.path / "out" / "latest" / "summary.json").read_text())
    assert summary["records"] == 200


def test_a_killed_worker_loses_no_other_record(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILL_ONE", "1")
    _, records = _run(pytester)
    crashed = [r for r in records if r.verdict == "crashed"]
    assert [r.test_id for r in crashed] == [
        "test_a_killed_worker_loses_no_other_record.py::test_compare[77]"
    ]
    assert "crashed" in str(crashed[0].message)
    others = [r for r in records if r.verdict == "passed"]
    assert len(others) == 199  # every record but the killed test's
    html = (pytester.path / "out" / "latest" / "drift.html").read_text()
    assert "crashed" in html


def test_a_cut_last_line_is_skipped_and_a_broken_middle_line_is_an_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    good = json.dumps({"test_id": "a", "verdict": "passed"})
    (tmp_path / "records.jsonl").write_text(good + "\n" + good[:10])
    assert len(read_records(tmp_path)) == 1
    (tmp_path / "records.jsonl").write_text(good[:10] + "\n" + good + "\n")
    with pytest.raises(ValueError, match=r"records.jsonl:1: not a JSON record"):
        read_records(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"expected a run folder holding records\.jsonl"):
        read_records(tmp_path / "nowhere")


def test_a_session_without_comparisons_writes_no_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_plain(): pass")
    pytester.runpytest("--report-dir", "out").assert_outcomes(passed=1)
    assert not (pytester.path / "out").exists()


RAISING = """
import pytest
import torch
from numalign.compare import CompareSpec, compare

@pytest.mark.parametrize("case", ["ok", "raises", "fails"])
def test_rms_norm(case, record_drift):
    t = torch.linspace(1, 2, 8, dtype=torch.float64)
    if case == "raises":
        raise RuntimeError("kernel launch failed: <unsupported shape 0x4097>")
    result = compare((t * 1.1 if case == "fails" else t).float(), t, CompareSpec(name="rms_norm"))
    record_drift(result, suite="operators", candidate="c", device="cpu", case=case)
    assert result.passed, result.message()

@pytest.fixture
def broken_model():
    raise OSError("model folder unreadable")

def test_setup(broken_model, record_drift):
    pass
"""


def test_an_exception_becomes_an_error_record_with_its_type_and_message(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(RAISING)
    run = pytester.runpytest_subprocess("-n", "2", "--report-dir", "out", "-p", "no:cacheprovider")
    records = {
        r.test_id.rpartition("::")[2]: r for r in read_records(pytester.path / "out" / "latest")
    }
    assert len(records) == 4  # every test that ran has a record
    raised = records["test_rms_norm[raises]"]
    assert (raised.verdict, raised.rule, raised.error) == ("error", "error", "RuntimeError")
    assert "kernel launch failed" in str(raised.reason) and "RuntimeError" in str(raised.message)
    assert records["test_rms_norm[fails]"].verdict == "failed"  # its comparison says why
    assert records["test_rms_norm[fails]"].error is None
    assert (records["test_setup"].verdict, records["test_setup"].error) == ("error", "OSError")
    summary = json.loads((pytester.path / "out" / "latest" / "summary.json").read_text())
    # tests as pytest counts them (a call that raised is a failed test, its record an error)
    assert summary["tests"] == {"failed": 2, "error": 1, "passed": 1}
    said = {"error" if k == "errors" else k: v for k, v in run.parseoutcomes().items()}
    assert summary["tests"] == {k: v for k, v in said.items() if k != "warnings"}
    assert summary["records_by_status"] == {"failed": 1, "error": 2, "passed": 1}
    html = (pytester.path / "out" / "latest" / "drift.html").read_text()
    assert "&lt;unsupported shape 0x4097&gt;" in html and "<unsupported shape" not in html


def test_records_without_a_comparison_keep_what_the_test_id_tells() -> None:
    from numalign.records.drift import context_from_test_id, crashed_record

    op = crashed_record(
        "suites/operators/test_operators.py::test_rms_norm[my-fused-bfloat16-unaligned-33x4097]",
        "worker 'gw1' crashed",
    )
    assert (op.suite, op.point, op.candidate, op.dtype, op.case) == (
        "operators", "rms_norm", "my-fused", "bfloat16", "unaligned-33x4097",
    )  # fmt: skip
    layer = context_from_test_id(
        "suites/models/test_layers.py::test_layer[tiny-llama/model.layers.1.mlp-float16]"
    )
    assert layer == {"suite": "models", "dtype": "float16", "model": "tiny-llama",
                     "candidate": "transformers", "point": "model.layers.1.mlp",
                     "mode": "isolated"}  # fmt: skip
    assert context_from_test_id("tests/test_x.py::test_plain") == {"suite": None}


def test_a_point_called_twice_in_one_request_keeps_both_records() -> None:
    """A module called twice in one forward (a shared block, a weight-tied layer) gives one
    record per call: their keys differ, so merging runs and diffing against a baseline keep
    both (before calls were counted, one silently replaced the other)."""
    from numalign.records.drift import DriftRecord
    from numalign.report.baseline import diff_runs
    from numalign.report.run import merge_records

    def record(call: int, used: float) -> DriftRecord:
        return DriftRecord(test_id="suites/models/test_model.py::test_model[shared-float32]",
                           point="model.shared_block", request="text", output="0",
                           call=call, budget_used=used)  # fmt: skip

    first, second = record(0, 0.1), record(1, 0.2)
    assert first.key != second.key
    # a first call's key is the key records had before calls were counted
    assert first.key == "::".join([first.test_id, "model.shared_block", "text", "0"])
    assert len(merge_records([[first, second]])) == 2
    # the second call regresses 5x (above the noise floor and twice the factor): found
    diff = diff_runs([first, record(1, 1.0)], [first, second])
    assert diff.compared == 2
    assert [r["key"] for r in diff.regressed] == [second.key]


def test_run_ids_differ_in_one_second_and_one_pid_namespace() -> None:
    """Issue 27, item 8: two shards in two containers (both pid 1) started in the same second
    shared one run folder; the random suffix tells them apart, and ids still sort by time."""
    from unittest import mock

    from numalign.records.drift import new_run_id

    with mock.patch("os.getpid", return_value=1):
        ids = {new_run_id(now=1.7e9) for _ in range(50)}
    assert len(ids) == 50
    assert new_run_id(now=1.7e9) < new_run_id(now=1.7e9 + 1)


#: One compiled decode record as each schema wrote it: schema 1 named the request in ``case``;
#: schema 2 in ``request``; schema 3 adds the variant's fields beside ``swap``.
_TEST = "suites/models/test_decode.py::test_decode[tiny-llama-bfloat16-static]"
_LABEL = "rms_norm=fused,compile=inductor:max-autotune,cache=static"
_OLD_RECORDS = (
    {"schema": 1, "test_id": _TEST, "suite": "models", "point": "model.norm", "case": "text",
     "swap": _LABEL, "verdict": "passed", "budget_used": 0.25},
    {"schema": 2, "test_id": _TEST, "suite": "models", "point": "model.norm",
     "request": "text", "output": "0", "step": 1, "swap": _LABEL, "verdict": "passed"},
)  # fmt: skip
_NEW_RECORD = {
    "schema": 3, "test_id": _TEST, "suite": "models", "point": "model.norm", "request": "text",
    "output": "0", "step": 1, "swap": _LABEL, "verdict": "passed", "engine": "transformers",
    "swaps": ["rms_norm=fused"], "compile_backend": "inductor", "compile_mode": "max-autotune",
    "tp": 1, "cache": "static",
}  # fmt: skip


def test_records_of_schemas_1_2_and_3_are_read_with_their_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every schema reads; the older ones keep their variant in ``swap`` alone (the fields
    stay None and say so by their schema), and no key changed: baselines still match."""
    from numalign.report.variants import compile_label

    lines = [json.dumps(r) for r in (*_OLD_RECORDS, _NEW_RECORD)]
    (tmp_path / "records.jsonl").write_text("\n".join(lines) + "\n")
    one, two, three = read_records(tmp_path)
    assert [r.schema for r in (one, two, three)] == [1, 2, 3]
    assert one.request == "text" and one.key == f"{_TEST}::model.norm::text::"
    assert two.key == three.key == f"{_TEST}::model.norm::text::0::step1"
    for old in (one, two):
        assert (old.swap, old.compile_backend, old.swaps, old.cache) == (_LABEL, None, None, None)
    assert (three.engine, three.swaps, three.tp, three.cache) == (
        "transformers", ["rms_norm=fused"], 1, "static",
    )  # fmt: skip
    # the reports read the compile variant either way: from swap before schema 3 only
    assert {compile_label(r) for r in (one, two, three)} == {"compile=inductor:max-autotune"}


def test_a_record_is_written_in_schema_6_and_keeps_its_schema_when_rewritten(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """New records say schema 6; an old record merged into a new file stays what it was (its
    fields were never filled), and a record without the field is schema 1."""
    from numalign.records.drift import SCHEMA_VERSION, DriftRecord, write_records

    assert SCHEMA_VERSION == 6 and DriftRecord(test_id="t").to_dict()["schema"] == 6
    old = DriftRecord.from_dict(_OLD_RECORDS[1])
    write_records(tmp_path / "records.jsonl", [old, DriftRecord.from_dict(_NEW_RECORD)])
    assert [r.schema for r in read_records(tmp_path)] == [2, 3]
    assert DriftRecord.from_dict({"test_id": "t"}).schema == 1
    (tmp_path / "records.jsonl").write_text(json.dumps({"schema": 7, "test_id": "t"}) + "\n")
    with pytest.raises(ValueError, match="not a drift record of schema 1 to 6"):
        read_records(tmp_path)


def test_power_is_written_finite_json_safe_and_older_records_read_without_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``detectable`` (schema 5) goes through records.jsonl as strict JSON, an infinite
    figure (a truth of zeros: no scale of it exists) as "Infinity" read back as the float;
    a record of schema 4 has none."""
    import math

    from numalign.records.drift import write_records

    record = DriftRecord(test_id="t", detectable={"scale": math.inf, "bias": 0.0125})
    write_records(tmp_path / "records.jsonl", [record])
    assert '"scale": "Infinity"' in (tmp_path / "records.jsonl").read_text()
    (back,) = read_records(tmp_path)
    assert back.detectable == {"scale": math.inf, "bias": 0.0125}
    assert DriftRecord.from_dict({"schema": 4, "test_id": "t"}).detectable is None
