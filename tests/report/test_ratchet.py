"""The ratchet: budgets loosened and power lost against a baseline run (issue 43, item 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from numalign.cli.nightly_flow import ratchet_lines
from numalign.compare import CompareSpec, compare
from numalign.compare.tolerances import Budget
from numalign.records.drift import DriftRecord, write_records
from numalign.report import diff_runs, render_run
from numalign.report.ratchet import RATCHET_FACTOR, ratchet

POINTS = ("model.layers.0.mlp", "model.layers.1.mlp", "model.norm")
REQUESTS = ("text-leftpad", "text-rightpad")


def records(
    *, seed: int = 0, loosen: str | None = None, fingerprint: str = "f" * 64
) -> list[DriftRecord]:
    """Real comparisons of a bfloat16 candidate against its truth and control, one record per
    point and request; ``loosen``: that point's budget multipliers tripled, as a changed
    pyproject override would."""
    out = []
    gen = torch.Generator().manual_seed(seed)
    for point in POINTS:
        for request in REQUESTS:
            truth = torch.randn(4, 64, generator=gen, dtype=torch.float64)
            noise = 1 + 2e-3 * torch.randn(truth.shape, generator=gen, dtype=torch.float64)
            budget = (
                Budget(max_abs_multiplier=12.0, rel_l2_multiplier=9.0) if point == loosen else None
            )
            spec = CompareSpec(control=truth.bfloat16(), budget=budget, name=point)
            result = compare((truth * noise).bfloat16(), truth, spec)
            record = DriftRecord.from_result(result, test_id="suites/models/test_model.py::"
                                             "test_model[tiny-x-bfloat16]")  # fmt: skip
            out.append(record.with_fields(point=point, request=request, output="0",
                                          suite="models", model="tiny-x", mode="accumulated",
                                          golden_fingerprint=fingerprint))  # fmt: skip
    return out


def test_a_loosened_budget_is_one_row_per_measure_at_its_point() -> None:
    baseline, current = records(), records(loosen="model.layers.1.mlp")
    loosened, weakened = ratchet(zip(current, baseline, strict=True))
    # the multipliers tripled: max_abs and rel_l2 grew 3x where the control's error sets
    # them (it does: a bfloat16 control of a float64 truth is far above the floors)
    assert {(r["point"], r["measure"]) for r in loosened} == {
        ("model.layers.1.mlp", "max_abs"), ("model.layers.1.mlp", "rel_l2"),
    }  # fmt: skip
    assert all(r["records"] == len(REQUESTS) and r["growth"] > RATCHET_FACTOR for r in loosened)
    assert all(not r["recaptured"] for r in loosened)
    # the point's passes now see less: its power figures grew with the budget
    assert {r["point"] for r in weakened} == {"model.layers.1.mlp"}
    assert {r["measure"] for r in weakened} <= {"scale", "bias"} and weakened


def test_honest_noise_and_a_tightened_budget_are_not_reported() -> None:
    """Another draw of the candidate's noise moves power a little (its figures read the
    truth and the budget, the scale rule the candidate's standard error), never beyond the
    factor; a budget that tightened is what a ratchet allows."""
    loose, honest = records(loosen="model.layers.1.mlp"), records(seed=0)
    assert ratchet(zip(honest, loose, strict=True)) == ([], [])
    reseeded = records(seed=0)
    for record in reseeded:  # the same truths, another candidate noise of the same size
        record.budget_used = (record.budget_used or 0.0) * 1.1
    assert ratchet(zip(reseeded, records(), strict=True)) == ([], [])


def test_power_lost_to_infinity_is_reported_and_nothing_caught_before_is_not() -> None:
    before, now = records(), records()
    now[0].detectable = {"scale": float("inf"), "bias": now[0].detectable["bias"]}
    _, weakened = ratchet([(now[0], before[0]), (before[0], now[0])])
    assert [(r["measure"], r["growth"]) for r in weakened] == [("scale", float("inf"))]


def test_a_run_against_its_baseline_writes_the_ratchet_and_the_nightly_prints_it(
    tmp_path: Path,
) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    for folder, recs in (
        (old, records()),
        (new, records(loosen="model.norm", fingerprint="e" * 64)),
    ):
        folder.mkdir()
        write_records(folder / "records.jsonl", recs)
    rendered = render_run(new, baseline=old)
    assert rendered.diff is not None and rendered.diff.regressed == []
    saved = json.loads((new / "regressions.json").read_text())
    assert {r["point"] for r in saved["loosened"]} == {"model.norm"}
    assert saved["ratchet_factor"] == RATCHET_FACTOR
    summary = json.loads((new / "summary.json").read_text())
    assert summary["ratchet"]["loosened"] == 2  # max_abs and rel_l2 of one point
    lines = ratchet_lines(new)
    assert lines[0].startswith("ratchet: 1 point with a budget loosened (up to ")
    assert "recaptured since the baseline: tiny-x" in lines[0]
    assert any(line.startswith("  loosened ") and "model.norm" in line for line in lines[1:])
    assert "Budgets loosened beyond" in (new / "drift.html").read_text()
    assert ratchet_lines(old) == []  # no baseline: no ratchet


def test_the_factor_must_be_above_one() -> None:
    with pytest.raises(ValueError, match="above 1"):
        ratchet([], factor=1.0)
    assert diff_runs([], []).loosened == []
