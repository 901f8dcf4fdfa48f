"""A decode test of a set captured without calibration (``--calibrate ''``) is skipped with a
record of rule ``uncalibrated``, as layer and model tests are, so that the run's verdict
counts it (NOT JUDGED); it was skipped with no record, invisible to the verdict."""

from __future__ import annotations

from pathlib import Path

import pytest

from numalign.core.errors import UNCALIBRATED
from numalign.records.drift import read_records

ROOT = Path(__file__).resolve().parents[2]


def test_an_uncalibrated_decode_test_leaves_a_record_that_says_so(
    pytester: pytest.Pytester, on_path: None
) -> None:
    from numalign.golden.capture_spec import CaptureSpec
    from numalign.replay.ensemble import capture_calibrated

    sets = pytester.path / "sets"
    spec = CaptureSpec(progress=False, continuation=1, decode_steps=1, long=0,
                       points=["model.layers.0.mlp"])  # fmt: skip
    capture_calibrated(ROOT / "golden" / "models" / "tiny-llama", sets / "bare-llama", spec,
                       calibrate=())  # fmt: skip
    result = pytester.runpytest_subprocess(
        str(ROOT / "suites" / "models" / "test_decode.py"), "--rootdir", str(ROOT),
        "-p", "no:cacheprovider", "--report-dir", str(pytester.path / "reports"), "-q", "-rs",
        "--golden", str(sets), "--golden-only", "--dtype", "bfloat16",
        "--cache-implementation", "dynamic",
    )  # fmt: skip
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*has no decode calibration*--calibrate bfloat16*"])
    run = (pytester.path / "reports" / "latest").resolve()
    [record] = [r for r in read_records(run) if r.rule == UNCALIBRATED]
    assert record.test_id.endswith("test_decode[bare-llama-bfloat16-dynamic]")
    assert record.verdict == "skipped"
