"""A capture says where it is in a log: one line per request and per calibration member
when stderr is not a terminal; the bar on a terminal; nothing when asked for nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from numalign.replay.ensemble import Member, capture_calibrated

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "golden" / "models" / "tiny-llama"


def test_a_capture_in_a_log_prints_one_line_per_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # one member (the reference alone) calibrating one dtype: the fewest steps that show both
    golden = capture_calibrated(
        MODEL, tmp_path / "set", calibrate=["bfloat16"], members=[Member("reference")],
        points=["model.layers.0.mlp"], decode_steps=0, long=0, progress=None,
    )  # fmt: skip
    lines = [
        line for line in capsys.readouterr().err.splitlines()
        if line.startswith("numalign capture set:")
    ]  # fmt: skip
    steps = len(golden.requests) + 1
    assert len(lines) == steps
    for i, line in enumerate(lines, 1):
        assert re.match(rf"numalign capture set: step {i}/{steps}: ", line), line
    assert lines[0].split(": ", 2)[2].startswith("request ")
    assert lines[-1].split(": ", 2)[2].startswith("calibrating bfloat16: ")


def test_a_capture_asked_for_no_progress_prints_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capture_calibrated(
        MODEL, tmp_path / "quiet", calibrate=[], points=["model.layers.0.mlp"],
        decode_steps=0, long=0, progress=False,
    )  # fmt: skip
    assert "numalign capture" not in capsys.readouterr().err
