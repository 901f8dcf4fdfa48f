"""A calibration member in a subprocess imports the numalign the capture runs, whatever the
working directory holds: a capture run from the parent of a clone (a folder that holds a
folder named ``numalign``) stopped with "No module named numalign.golden.manifest", its
members importing that folder instead."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from numalign.replay.ensemble import Member, run_members

ROOT = Path(__file__).resolve().parents[2]


def _set_copy(tmp_path: Path) -> Path:
    """tiny-llama's golden set and model folder copied under ``tmp_path`` (the set names its
    model by a path relative to itself)."""
    for kind in ("sets", "models"):
        shutil.copytree(ROOT / "golden" / kind / "tiny-llama", tmp_path / kind / "tiny-llama")
    return tmp_path / "sets" / "tiny-llama"


@pytest.mark.parametrize("shadow", ["the parent of a clone", "a bogus package"])
def test_a_member_imports_the_capture_s_numalign_from_any_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shadow: str
) -> None:
    golden = _set_copy(tmp_path)
    cwd = tmp_path / "work"
    if shadow == "the parent of a clone":  # a clone named numalign: no __init__.py in it
        (cwd / "numalign" / "src" / "numalign").mkdir(parents=True)
        (cwd / "numalign" / "golden" / "sets").mkdir(parents=True)
    else:  # a package named numalign that is not this one
        (cwd / "numalign").mkdir(parents=True)
        (cwd / "numalign" / "__init__.py").write_text("raise ImportError('the wrong numalign')\n")
    monkeypatch.chdir(cwd)
    # an environment variable makes it a subprocess member; float32 alone, one thread
    member = Member("default kernels", {"ATEN_CPU_CAPABILITY": "default"}, threads=1)
    assert not member.in_process
    [(ran, result)] = run_members([(member, ["float32"])], golden)
    assert ran is member
    assert result.tables["float32"]  # it calibrated: every point of the set has statistics
    assert "model.layers.0" in result.tables["float32"]
