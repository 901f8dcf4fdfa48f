"""Disk you can predict: the truth cache kept under its cap (least recently used first,
``numalign cache info|prune``), report folders keeping their newest runs (``--keep-runs``),
and nothing removed that numalign did not write."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from numalign.cli import main
from numalign.ops import check as opcheck
from numalign.ops.registry import OPERATORS, load_catalogue
from numalign.ops.truths import TruthCache, cache_entries, cache_size, prune_truths
from numalign.report.retention import prune_runs, run_folders
from numalign.session.option_values import parse_size

load_catalogue()
RMS = OPERATORS["rms_norm"]


def _entry(folder: Path, op: str, name: str, size: int, age_s: float) -> Path:
    """A file named as the cache names its entries, ``age_s`` seconds since its last use."""
    path = folder / op / f"{name}-{'ab' * 16}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    stamp = 1_700_000_000 - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_prune_removes_the_least_recently_used_first_and_nothing_foreign(tmp_path: Path) -> None:
    old = _entry(tmp_path, "rms_norm", "old", 1000, age_s=300)
    mid = _entry(tmp_path, "softmax", "mid", 1000, age_s=200)
    new = _entry(tmp_path, "rms_norm", "new", 1000, age_s=100)
    foreign = tmp_path / "rms_norm" / "notes.safetensors"  # not of the cache's naming
    foreign.write_bytes(b"y" * 5000)
    assert [p for p, _, _ in cache_entries(tmp_path)] == [old, mid, new]
    assert prune_truths(tmp_path, 2000) == (1, 1000)
    assert not old.exists() and mid.exists() and new.exists() and foreign.exists()
    assert prune_truths(tmp_path, 0) == (2, 2000)
    assert foreign.exists() and cache_size(tmp_path) == 0


def test_a_capped_cache_evicts_down_below_its_cap_as_it_writes(tmp_path: Path) -> None:
    cache = TruthCache(tmp_path)
    opcheck._truths.clear()
    case, *others = list(RMS.cases)[:3]
    first = cache.store(
        RMS, case, torch.bfloat16, *opcheck.inputs_and_truth(RMS, case, torch.bfloat16)
    )
    assert first is not None
    size = first.stat().st_size
    # room for two entries of this size and a half: a third write evicts the oldest
    cache.max_bytes = int(2.5 * size)
    os.utime(first, (1_000_000, 1_000_000))  # the first is the least recently used
    for other in others:
        inputs, truth = opcheck.inputs_and_truth(RMS, other, torch.bfloat16)
        assert cache.store(RMS, other, torch.bfloat16, inputs, truth) is not None
    opcheck._truths.clear()
    assert cache.stats["written"] == 3
    assert cache_size(tmp_path) <= cache.max_bytes
    assert cache.stats["evicted"] >= 1 and not first.exists()


def test_a_hit_marks_its_entry_as_recently_used(tmp_path: Path) -> None:
    cache = TruthCache(tmp_path)
    case = RMS.cases[0]
    opcheck._truths.clear()
    inputs, truth = opcheck.inputs_and_truth(RMS, case, torch.bfloat16)
    opcheck._truths.clear()
    path = cache.store(RMS, case, torch.bfloat16, inputs, truth)
    assert path is not None
    os.utime(path, (1_000_000, 1_000_000))
    assert cache.load(RMS, case, torch.bfloat16) is not None
    assert path.stat().st_mtime > 1_000_000


def test_cache_info_and_prune_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _entry(tmp_path, "rms_norm", "a", 2_000_000, age_s=20)
    _entry(tmp_path, "rms_norm", "b", 2_000_000, age_s=10)
    assert main(["cache", "info", "--cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path}: 2 entries, 4.0 MB" in out and "rms_norm" in out
    assert main(["cache", "prune", "--cache", str(tmp_path), "--max-size", "3MB"]) == 0
    assert "removed 1 entries, 2.0 MB" in capsys.readouterr().out
    assert main(["cache", "prune", "--cache", str(tmp_path), "--all"]) == 0
    assert cache_size(tmp_path) == 0
    with pytest.raises(SystemExit) as exc:
        main(["cache", "prune", "--cache", str(tmp_path), "--max-size", "lots"])
    assert "--max-size 'lots': give a size such as 4GB" in str(exc.value.code)


def test_sizes_read_as_people_write_them() -> None:
    assert parse_size("4GB", "--x") == 4 * 10**9
    assert parse_size("2GiB", "--x") == 2 * 2**30
    assert parse_size("500 MB", "--x") == 500 * 10**6
    assert parse_size("0", "--x") == 0
    with pytest.raises(ValueError, match="--truth-cache-size '4 parsecs'"):
        parse_size("4 parsecs", "--truth-cache-size")


def _run(reports: Path, name: str, age_s: float, **header: object) -> Path:
    folder = reports / name
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("")
    (folder / "summary.json").write_text(json.dumps({"run_id": name, **header}))
    stamp = 1_700_000_000 - age_s
    os.utime(folder / "records.jsonl", (stamp, stamp))
    return folder


def test_keep_runs_keeps_the_newest_the_latest_and_the_baseline(tmp_path: Path) -> None:
    runs = [_run(tmp_path, f"run{i}", age_s=100 - i) for i in range(6)]  # run5 newest
    (tmp_path / "latest").symlink_to("run1")
    merged = _run(tmp_path, "merged", age_s=1000, merged_from=["a", "b"])  # the user's
    other = tmp_path / "notes"
    other.mkdir()
    assert run_folders(tmp_path) == runs
    removed = prune_runs(tmp_path, 2, protect=[runs[0]])  # run0: the baseline
    assert removed == [runs[2], runs[3]]
    assert [r.exists() for r in runs] == [True, True, False, False, True, True]
    assert merged.exists() and other.exists()
    assert prune_runs(tmp_path, 0) == []  # 0: keep every run


def test_a_session_prunes_old_runs_and_says_so(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch
        from numalign.compare import CompareSpec, compare

        def test_one(record_drift):
            t = torch.ones(4, dtype=torch.float64)
            record_drift(compare(t.float(), t, CompareSpec(name="p")), suite="operators")
        """
    )
    for i in range(3):
        _run(pytester.path / "out", f"2020010{i}-000000-1", age_s=10_000 - i)
    result = pytester.runpytest_subprocess("--report-dir", "out", "--keep-runs", "2")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["numalign: removed 2 old run(s) of out (--keep-runs 2)"])
    assert len(run_folders(pytester.path / "out")) == 2  # this run and the newest old one
    bad = pytester.runpytest_subprocess("--report-dir", "out", "--keep-runs", "some")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--keep-runs 'some': give a whole number*"])
