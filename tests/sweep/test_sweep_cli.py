"""``numalign zoo sweep`` from the command line: bad selections are errors naming the fix;
a resumed sweep whose rows regressed against --baseline says so and, with
--fail-on-regression, exits 1; and (tier nightly) a real sweep of two types: one clean with
its planted norm caught at a norm, one that transformers cannot build listed with its
message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from numalign.cli import main
from numalign.sweep.table import SweepRow, append_row, read_rows

ROOT = Path(__file__).resolve().parents[2]


def test_an_unknown_type_is_an_error_naming_the_mapping() -> None:
    with pytest.raises(SystemExit, match=r"unknown model types \['llamma'\]: not in the installed"):
        main(["zoo", "sweep", "--types", "llamma", "--suites", str(ROOT / "suites")])
    with pytest.raises(SystemExit, match="name types with --types a,b"):
        main(["zoo", "sweep", "llama"])


def test_a_regression_against_the_baseline_fails_the_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline, out = tmp_path / "previous.csv", tmp_path / "sweep"
    out.mkdir()
    append_row(baseline, SweepRow("llama", "yes", "ok", "clean"))
    append_row(out / "sweep.csv", SweepRow("llama", "yes", "ok", "not clean", false_alarms=1))
    append_row(out / "sweep.csv", SweepRow("qwen3", "yes", "ok", "clean"))
    args = ["zoo", "sweep", "--types", "llama,qwen3", "--out", str(out), "--resume",
            "--suites", str(ROOT / "suites"), "--baseline", str(baseline)]  # fmt: skip
    assert main(args) == 0  # reported, not failed, without --fail-on-regression
    assert main([*args, "--fail-on-regression"]) == 1
    printed = capsys.readouterr().out
    assert "numalign sweep: regression llama: was clean, now ok / not clean" in printed
    assert "numalign sweep: new type qwen3: clean" in printed


@pytest.mark.nightly
def test_a_sweep_of_two_types(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "numalign.cli", "zoo", "sweep", "--types", "llama,reformer",
         "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=ROOT, check=False, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    llama, reformer = read_rows(tmp_path / "sweep.csv")
    assert llama.clean and llama.planted.endswith("(norm)"), llama
    assert reformer.built.startswith("no: AssertionError") and "is_decoder" in reformer.built
    assert "| llama | yes | ok | clean" in (tmp_path / "sweep.md").read_text()
