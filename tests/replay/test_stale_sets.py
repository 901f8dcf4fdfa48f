"""A stale golden set fails its first test with the message that says how to recapture it;
its other tests fail at once naming that test, without hashing the model again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from numalign.golden.capture_spec import CaptureSpec
from numalign.replay.ensemble import capture_calibrated

ROOT = Path(__file__).resolve().parents[2]
#: Points captured: enough tests (one per point) to tell once from every time.
POINTS = ["model.layers.0.mlp", "model.layers.1.mlp", "model.layers.0.self_attn"]


def test_a_stale_set_fails_every_test_and_names_the_first(tmp_path: Path) -> None:
    model = tmp_path / "models" / "tiny-llama-stale"
    shutil.copytree(ROOT / "golden" / "models" / "tiny-llama", model)
    spec = CaptureSpec(points=POINTS, decode_steps=0, long=0, progress=False)
    golden = capture_calibrated(
        model, tmp_path / "sets" / "tiny-llama-stale", spec, calibrate=["float32"]
    )
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-5}))  # changed
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "suites/models/test_layers.py", "-p", "no:cacheprovider",
         "--golden", str(golden.path), "--golden-only", "--dtype", "float32",
         "--report-dir", str(tmp_path / "reports"), "-rs", "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout
    last = out.strip().splitlines()[-1]
    # every test of the set fails (a -k that left out its first would else be green)
    assert f"{len(POINTS)} failed" in last and "skipped" not in last, out
    # the set's other tests fail at once, naming the one that carries the whole message
    first = "its first test's: suites/models/test_layers.py::test_layer[tiny-llama-stale/"
    assert first in out
    assert "numalign capture" in out  # the failure says how to recapture
