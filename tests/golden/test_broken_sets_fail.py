"""Every selected test of a golden set replay cannot use fails, whatever ``-k`` selects: an
unreadable set failed one test and skipped its others citing it, so a ``-k`` that deselected
that one test, with other sets beside it, ended green (exit 0) with the broken set untested.
Now the first selected test of such a set fails with the set's message and its other selected
tests fail naming that test (without opening the set again)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _copy(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A zoo set and its model copied under ``tmp_path`` (the set names its model by a path
    relative to itself); (the set, the model)."""
    for kind in ("sets", "models"):
        shutil.copytree(ROOT / "golden" / kind / name, tmp_path / kind / name)
    return tmp_path / "sets" / name, tmp_path / "models" / name


def test_every_selected_test_of_a_broken_set_fails(tmp_path: Path) -> None:
    healthy, _ = _copy(tmp_path, "tiny-bert")
    stale, stale_model = _copy(tmp_path, "tiny-llama")
    config = json.loads((stale_model / "config.json").read_text())
    (stale_model / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-5}))
    unreadable, _ = _copy(tmp_path, "tiny-mistral")
    with (unreadable / "manifest.json").open("a", encoding="utf-8") as fh:
        fh.write("not json\n")
    # neither broken set's first test (its decode test) is selected: the stale set's second
    # layer's five points, the unreadable set's model test, and one test of the healthy set
    selected = "tiny-llama/model.layers.1 or test_model and tiny-mistral or word_embeddings"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "suites/models", "-p", "no:cacheprovider", "-p",
         "no:xdist", "--golden", str(healthy), "--golden", str(stale), "--golden",
         str(unreadable), "--golden-only", "--dtype", "float32", "-k", selected,
         "--report-dir", str(tmp_path / "reports"), "-q", "-rfs"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 1, out  # tests failed: never a green run
    last = out.strip().splitlines()[-1]
    # 5 points of the stale set's layer 1 and the unreadable set's model test fail; the
    # healthy set's one test passes; none is skipped
    assert re.search(r"\b6 failed, 1 passed\b", last) and "skipped" not in last, out
    failed = re.findall(r"^FAILED (\S+)", out, re.MULTILINE)
    assert len([f for f in failed if "tiny-llama/model.layers.1" in f]) == 5, out
    assert "suites/models/test_model.py::test_model[tiny-mistral-float32]" in failed, out
    assert "numalign capture" in out  # the stale set's message says how to recapture
    assert "not valid JSON" in out  # the unreadable set's says what is wrong
    # the stale set's other tests name the one that carries its whole message
    first = next(f for f in failed if "tiny-llama" in f)
    sections = dict(re.findall(r"^_+ (test_\S+) _+$\n(.*?)(?=^_+ test_|^-+ numalign)", out,
                               re.MULTILINE | re.DOTALL))  # fmt: skip
    others = [f.split("::")[-1] for f in failed if "tiny-llama" in f and f != first]
    assert len(others) == 4 and all(f"its first test's: {first}" in sections[o] for o in others)
    assert "its first test's" not in sections[first.split("::")[-1]], out
