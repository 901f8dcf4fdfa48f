"""A capture says where it is in a log: one line per request and per calibration member
when stderr is not a terminal; the bar on a terminal; nothing when asked for nothing."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from numalign.golden.capture_spec import CaptureSpec
from numalign.replay.ensemble import Member, capture_calibrated

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "golden" / "models" / "tiny-llama"


def test_a_capture_in_a_log_prints_one_line_per_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # one member (the reference alone) calibrating one dtype: the fewest steps that show both
    spec = CaptureSpec(points=["model.layers.0.mlp"], decode_steps=0, long=0, progress=None)
    golden = capture_calibrated(
        MODEL, tmp_path / "set", spec, calibrate=["bfloat16"], members=[Member("reference")]
    )
    lines = [
        line for line in capsys.readouterr().err.splitlines()
        if line.startswith("numalign capture set:")
    ]  # fmt: skip
    # after the capture's steps, one line of the power computed from the calibration
    assert re.match(r"numalign capture set: power per point written to its manifest, median "
                    r"detectable scale bfloat16 \d", lines.pop()), lines  # fmt: skip
    assert set(golden.manifest.power) == {"bfloat16"}
    steps = len(golden.requests) + 1
    assert len(lines) == steps + 1  # each step's line, then the closing one
    for i, line in enumerate(lines[:-1], 1):
        assert re.match(rf"numalign capture set: step {i}/{steps}: ", line), line
    assert lines[0].split(": ", 2)[2].startswith("request ")
    assert lines[-2].split(": ", 2)[2].startswith("calibrating bfloat16: ")
    assert re.match(rf"numalign capture set: done, {steps} steps \(\d+ s so far\)$", lines[-1])


def test_a_long_step_is_never_silent(capsys: pytest.CaptureFixture[str]) -> None:
    from numalign.golden.progress import Progress

    progress = Progress("lines", 2, "set", heartbeat=0.01)
    progress.step("request long-leftpad")
    beats = []
    for _ in range(1000):  # the heartbeat thread prints while the step runs (waits 0.01 s)
        beats = [x for x in capsys.readouterr().err.splitlines() if "still on" in x]
        if beats:
            break
        time.sleep(0.01)
    progress.close()
    assert beats, "no line while the step ran"
    assert re.match(
        r"numalign capture set: still on step 1/2 after \d+ s: request long-leftpad", beats[0]
    )


def test_a_capture_asked_for_no_progress_prints_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = CaptureSpec(points=["model.layers.0.mlp"], decode_steps=0, long=0, progress=False)
    capture_calibrated(MODEL, tmp_path / "quiet", spec, calibrate=[])
    assert "numalign capture" not in capsys.readouterr().err
