"""Compiled against eager in drift.html: a compiled run rendered with an eager run as its
baseline shows both uses of budget side by side, per operator or model, dtype and mode, and
each side's compile and run time; a compiled run alone shows its compile cost."""

from __future__ import annotations

import math

from numalign.records.drift import DriftRecord
from numalign.report.html import render_html
from numalign.report.variants import compile_label, compile_label_of_swap, side_by_side

HEADER = {"run_id": "compiled", "device": "cpu", "dtypes": ["bfloat16"], "tier": "pr"}


def _record(test: str, point: str, used: float, **fields: object) -> DriftRecord:
    return DriftRecord(
        test_id=f"suites/models/test_model.py::test_model[{test}]", suite="models",
        point=point, dtype="bfloat16", model="tiny-llama", mode="accumulated",
        request="text-leftpad", budget_used=used, duration_s=2.0,
        verdict="passed" if used <= 1.0 else "failed", **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def _runs() -> tuple[list[DriftRecord], list[DriftRecord]]:
    eager = [_record("tiny-llama-bfloat16", p, u) for p, u in (("a", 0.25), ("b", 0.2))]
    compiled = [
        _record("tiny-llama-bfloat16", p, u, swap="compile=inductor", compile_s=30.0,
                graph_breaks=0, compile_backend="inductor")
        for p, u in (("a", 0.5), ("b", 0.1))
    ]  # fmt: skip
    return eager, compiled


def test_the_compile_label_is_read_from_the_variant_fields() -> None:
    """Schema 3 names the compile variant in fields; ``swap`` is not parsed for it."""
    compiled = _record("t-bfloat16", "a", 0.1, compile_backend="inductor",
                       compile_mode="max-autotune", swap="rms_norm=fused")  # fmt: skip
    assert compile_label(compiled) == "compile=inductor:max-autotune"
    assert compile_label(_record("t-bfloat16", "a", 0.1, swap="compile=inductor")) is None


def test_records_before_schema_3_have_the_label_read_from_swap() -> None:
    assert compile_label_of_swap("rms_norm=fused,compile=inductor:max-autotune") == (
        "compile=inductor:max-autotune"
    )
    assert compile_label_of_swap("attention=sdpa") is None and compile_label_of_swap(None) is None
    for schema in (1, 2):
        old = _record("t-bfloat16", "a", 0.1, swap="attention=sdpa,compile=aot_eager",
                      schema=schema)  # fmt: skip
        assert compile_label(old) == "compile=aot_eager"


def test_an_old_compiled_run_is_still_put_beside_a_new_eager_one() -> None:
    """A compiled run recorded in schema 2 (its variant in ``swap`` alone) against an eager
    run of schema 3: the section is built as before."""
    eager, compiled = _runs()
    old = [r.with_fields(schema=2, compile_backend=None) for r in compiled]
    both = side_by_side(eager, old)
    assert both is not None and both["labels"] == ["compile=inductor"]
    assert not both["compiled_is_current"]


def test_compiled_and_eager_runs_are_put_side_by_side() -> None:
    eager, compiled = _runs()
    both = side_by_side(compiled, eager)
    assert both is not None and both["labels"] == ["compile=inductor"]
    (row,) = both["rows"]
    assert (row["eager"], row["compiled"], row["worst_point"]) == (0.25, 0.5, "a")
    assert math.isclose(row["ratio"], 2.0)
    # one test: its compile time counts once, not once per record
    assert both["compiled_cost"]["compile_s"] == 30.0 and both["eager_cost"]["run_s"] == 2.0
    assert side_by_side(eager, compiled) is not None  # either run may be the baseline
    assert side_by_side(eager, eager) is None  # nothing compiled: no section


def test_drift_html_shows_the_section_with_both_uses() -> None:
    eager, compiled = _runs()
    html = render_html(compiled, HEADER, variants=side_by_side(compiled, eager))
    assert 'id="compiled"' in html and "Compiled against eager" in html
    assert "30.0 s compiling" in html
    assert ">0.25<" in html and ">0.5<" in html and ">2.00<" in html
    cost = {"labels": ["compile=inductor"], "compile_s": 30.0, "run_s": 2.0,
            "graph_breaks": 0.0, "tests": 1.0}  # fmt: skip
    alone = render_html(compiled, HEADER, compiled=cost)
    assert "30.0 s compiling" in alone and "--drift-baseline an eager run" in alone
    assert 'id="compiled"' not in render_html(eager, HEADER)
