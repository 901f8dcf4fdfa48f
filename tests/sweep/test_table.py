"""The sweep's table: rows appended as types finish (an interrupted sweep keeps them, a
resumed one skips them), the summary's counts, the markdown, the changes against a previous
sweep, the type selection's errors, and a type that hangs listed as a crash."""

from __future__ import annotations

from pathlib import Path

import pytest

from numalign.sweep import run as run_module
from numalign.sweep.run import select_types, sweep
from numalign.sweep.table import SweepRow, append_row, changes, markdown, read_rows, summary

CLEAN = SweepRow("llama", "yes", "ok", "clean (34 passed, 0 skipped)", 0, 0,
                 "model.layers.0.input_layernorm (norm)", 40.0)  # fmt: skip
ALARM = SweepRow("cohere2", "yes", "ok", "not clean (30 passed, 2 skipped)", 2, 0,
                 "model.norm (norm)", 50.0)  # fmt: skip
UNBUILT = SweepRow("reformer", "no: AssertionError: make sure that `is_decoder=True`")


def test_rows_are_appended_and_read_back(tmp_path: Path) -> None:
    table = tmp_path / "sweep.csv"
    for row in (CLEAN, ALARM, UNBUILT):
        append_row(table, row)
    assert read_rows(table) == [CLEAN, ALARM, UNBUILT]
    append_row(table, SweepRow("cohere2", "yes", "ok", "clean", seconds=1.0))  # a rerun wins
    assert [r.replay for r in read_rows(table)] == [CLEAN.replay, "clean", UNBUILT.replay]


def test_the_summary_counts_clean_among_built_types() -> None:
    assert summary([CLEAN, ALARM, UNBUILT]) == (
        "3 types; 2 built; 1 of them clean (50%); 0 crashes; planted norm caught at a norm in "
        "2 of 2 planted"
    )
    missed = SweepRow("gpt2", "yes", "ok", "clean", planted="not caught")
    unplanted = SweepRow("cohere2", "yes", "ok", "clean", planted="not planted: no norm module")
    assert summary([CLEAN, missed, unplanted]).endswith("caught at a norm in 1 of 2 planted")
    # a point that holds a planted norm capture does not (OLMo-2's q_norm in attention)
    # counts; a point that holds none does not
    held = "model.layers.0.self_attn (norm inside: model.layers.0.self_attn.q_norm)"
    inside = SweepRow("flex_olmo", "yes", "ok", "clean", planted=held)
    outside = SweepRow("gpt2", "yes", "ok", "clean", planted="model.layers.0.mlp (not a norm)")
    assert summary([inside, outside]).endswith("caught at a norm in 1 of 2 planted")
    text = markdown([CLEAN, UNBUILT], "Sweep of today")
    assert text.splitlines()[0] == "Sweep of today"
    assert "| reformer | no: AssertionError: make sure that `is_decoder=True` | - |" in text


def test_changes_name_new_types_and_regressions() -> None:
    now = [SweepRow("llama", "yes", "ok", "not clean", 1), ALARM, UNBUILT]
    assert changes([CLEAN, UNBUILT], now) == [
        "regression llama: was clean, now ok / not clean",
        "new type cohere2: not clean (30 passed, 2 skipped)",
    ]


def test_select_types_names_the_unknown_ones() -> None:
    assert select_types(["a", "b", "c"], None, 2) == ["a", "b"]
    assert select_types(["a", "b", "c"], ["c", "a"], None) == ["c", "a"]
    assert select_types(["a", "b", "c", "d", "e"], None, None, "2/2") == ["b", "d"]
    with pytest.raises(ValueError, match="--shard 3/2: write I/N with 1 <= I <= N"):
        select_types(["a"], None, None, "3/2")
    with pytest.raises(ValueError, match=r"unknown model types \['llamma'\]"):
        select_types(["llama"], ["llamma"], None)


def test_a_sweep_keeps_finished_rows_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    swept: list[str] = []

    def fake_one(model_type: str, work: Path, suites: Path, timeout: float) -> SweepRow:
        if model_type == "boom":
            raise KeyboardInterrupt  # the sweep interrupted while this type ran
        swept.append(model_type)
        return SweepRow(model_type, "yes", "ok", "clean")

    monkeypatch.setattr(run_module, "_one", fake_one)
    monkeypatch.setattr(run_module, "heading", lambda command: "Sweep")
    with pytest.raises(KeyboardInterrupt):
        sweep(["llama", "boom", "qwen3"], tmp_path, tmp_path)
    assert [r.type for r in read_rows(tmp_path / "sweep.csv")] == ["llama"]
    assert "| llama | yes | ok | clean |" in (tmp_path / "sweep.md").read_text()
    rows = sweep(["llama", "qwen3"], tmp_path, tmp_path, resume=True)
    assert swept == ["llama", "qwen3"]  # llama was not swept twice
    assert [r.type for r in rows] == ["llama", "qwen3"]


def test_a_type_that_hangs_is_a_crash_row_and_the_sweep_goes_on(tmp_path: Path) -> None:
    # 0.5 s: less than the child needs to import torch, so the child is stopped mid-way
    row = run_module._one("llama", tmp_path, tmp_path, timeout=0.5)
    assert row.crashes == 1
    assert row.replay == "crash: timed out after 0 s"  # the timeout, rounded to seconds
