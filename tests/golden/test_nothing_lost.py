"""Capture never destroys what numalign did not write, and discovery never replays numalign's
own temporary or previous folders."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from numalign.golden import GoldenSet, GoldenSetError
from numalign.golden.capture import capture
from numalign.golden.capture_spec import CaptureSpec
from numalign.golden.folders import MARKER, mark, remove_abandoned, temporary_folder
from numalign.golden.store import discover_sets, replace_set
from numalign.golden.target import CaptureTargetError


def _capture(model: Path, out: Path, *, force: bool = False) -> GoldenSet:
    spec = CaptureSpec(continuation=0, decode_steps=0, long=0, progress=False, force=force)
    return capture(model, out, spec)


@pytest.fixture
def llama_set(tmp_path: Path, model_copy: Path) -> GoldenSet:
    return _capture(model_copy, tmp_path / "sets" / "llama")


def test_out_at_a_folder_of_sets_is_refused_and_the_sets_stay(
    llama_set: GoldenSet, model_copy: Path
) -> None:
    sets = llama_set.path.parent
    before = sorted(p.name for p in llama_set.path.iterdir())
    with pytest.raises(CaptureTargetError, match=r"holds 1 golden set\(s\) \(llama\), it is not"):
        _capture(model_copy, sets)  # the set's name forgotten
    assert sorted(p.name for p in llama_set.path.iterdir()) == before
    GoldenSet.open(llama_set.path).verify()


def test_out_at_documents_or_at_the_model_is_refused(tmp_path: Path, model_copy: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "thesis.txt").write_text("years of work")
    with pytest.raises(CaptureTargetError, match=r"not a golden set and not empty .*thesis.txt"):
        _capture(model_copy, docs)
    assert (docs / "thesis.txt").read_text() == "years of work"
    weights = (model_copy / "model.safetensors").read_bytes()
    with pytest.raises(CaptureTargetError, match=r"is a model folder"):
        _capture(model_copy, model_copy)
    assert (model_copy / "model.safetensors").read_bytes() == weights


def test_a_set_holding_foreign_files_is_not_replaced(
    llama_set: GoldenSet, model_copy: Path
) -> None:
    (llama_set.path / "notes.md").write_text("mine")
    with pytest.raises(CaptureTargetError, match=r"files numalign did not write \(notes.md\)"):
        _capture(model_copy, llama_set.path)
    assert (llama_set.path / "notes.md").read_text() == "mine"


def test_a_set_of_another_model_needs_force_and_is_kept_under_versions(
    llama_set: GoldenSet, model_copy: Path, tmp_path: Path
) -> None:
    other = tmp_path / "models" / "other-llama"
    shutil.copytree(model_copy, other)
    with pytest.raises(CaptureTargetError, match=r"another model .*pass --force"):
        _capture(other, llama_set.path)
    assert GoldenSet.open(llama_set.path).model_dir == model_copy.resolve()
    golden = _capture(other, llama_set.path, force=True)
    assert golden.model_dir == other.resolve()
    kept = list((llama_set.path.parent / ".versions" / "llama").iterdir())
    assert len(kept) == 1 and GoldenSet.open(kept[0]).model_dir == model_copy.resolve()
    assert discover_sets([llama_set.path.parent]) == [llama_set.path]  # .versions is not a set
    # the same model again replaces without --force, and keeps nothing more
    _capture(other, llama_set.path)
    assert len(list((llama_set.path.parent / ".versions" / "llama").iterdir())) == 1


def test_the_cli_names_what_is_at_out_and_exits_non_zero(tmp_path: Path, model_copy: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("x")
    out = subprocess.run(
        [sys.executable, "-m", "numalign.cli", "capture", str(model_copy), "--out", str(docs)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
    )
    assert out.returncode == 1
    assert f"numalign capture: --out {docs}: is not a golden set" in out.stderr
    assert "Traceback" not in out.stderr and (docs / "a.txt").exists()


def test_a_killed_capture_folder_is_not_discovered_nor_removed_unmarked(
    llama_set: GoldenSet,
) -> None:
    sets = llama_set.path.parent
    tmp = temporary_folder(llama_set.path)  # as a capture makes it, then SIGKILLed
    for p in llama_set.path.iterdir():
        shutil.copy(p, tmp / p.name)  # a whole manifest: it looked like a set before
    assert discover_sets([sets]) == [llama_set.path]
    # a user's folder that only looks like one by name is a set, and is never removed
    lookalike = sets / ".notes.capture-1"
    shutil.copytree(llama_set.path, lookalike)
    assert lookalike in discover_sets([sets])
    data = json.loads((tmp / MARKER).read_text())
    data["pid"] = _dead_pid()
    (tmp / MARKER).write_text(json.dumps(data))
    assert remove_abandoned(sets) == [tmp]
    assert not tmp.exists() and lookalike.is_dir()


def test_a_live_capture_folder_is_not_discovered(llama_set: GoldenSet) -> None:
    tmp = temporary_folder(llama_set.path)
    shutil.copy(llama_set.path / "manifest.json", tmp / "manifest.json")
    assert discover_sets([tmp]) == []  # given directly, too (a --golden pointing at it)
    assert remove_abandoned(llama_set.path.parent) == []  # this process is alive


def test_an_interrupted_replacement_leaves_a_previous_that_is_not_replayed(
    llama_set: GoldenSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    sets, out = llama_set.path.parent, llama_set.path
    tmp = temporary_folder(out)
    calls: list[tuple[object, object]] = []
    real = os.replace

    def killed_second(src: object, dst: object) -> None:
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed between moving the old set aside and the new in
        real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", killed_second)
    with pytest.raises(KeyboardInterrupt):
        replace_set(tmp, out)
    monkeypatch.undo()
    previous = sets / "llama.previous"
    assert previous.is_dir() and not out.exists()
    assert discover_sets([sets]) == []
    with pytest.raises(GoldenSetError, match=r"interrupted while replacing it: mv "):
        GoldenSet.open(out)
    previous.rename(out)  # the user's remedy: the set is a set again
    assert discover_sets([sets]) == [out]
    GoldenSet.open(out).verify()


def test_a_previous_folder_numalign_did_not_mark_is_never_deleted(
    llama_set: GoldenSet,
) -> None:
    previous = llama_set.path.with_name("llama.previous")
    previous.mkdir()
    (previous / "keep.txt").write_text("mine")
    tmp = temporary_folder(llama_set.path)
    with pytest.raises(GoldenSetError, match=r"not a previous set numalign marked"):
        replace_set(tmp, llama_set.path)
    assert (previous / "keep.txt").read_text() == "mine"
    mark(previous, "capture")  # a marker for another name does not make it numalign's
    (previous / MARKER).write_text(json.dumps({"kind": "previous", "name": "other"}))
    with pytest.raises(GoldenSetError, match=r"not a previous set numalign marked"):
        replace_set(tmp, llama_set.path)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (pids are not reused this quickly)


def test_a_non_finite_reference_is_refused_naming_the_first_point(
    tmp_path: Path, model_copy: Path
) -> None:
    """Issue 27, item 10: one inf weight captured 100% NaN logits that every replay passed."""
    from safetensors.torch import load_file, save_file

    from numalign.golden.nonfinite import NonFiniteReferenceError

    weights = model_copy / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    where = r"not finite: model.layers.1.mlp output .* of request text-\w+ holds \d+ NaN or Inf"
    with pytest.raises(NonFiniteReferenceError, match=where):
        _capture(model_copy, tmp_path / "sets" / "inf-llama")
    assert not (tmp_path / "sets").exists() or not any((tmp_path / "sets").iterdir())
