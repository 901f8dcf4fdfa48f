"""The capture hashes the checkpoint on a thread of its own, beside its own reads
(``fingerprint.BackgroundFingerprint``): the same fingerprint as a hash before the load, the
checks that need no read raised at once, a failure of the thread raised to the capture (the
set never placed), and a failed capture stopping the thread."""

from __future__ import annotations

import importlib
import threading
from pathlib import Path
from typing import Any

import pytest

from numalign.golden import capture as capture_module
from numalign.golden.capture import capture
from numalign.golden.capture_spec import CaptureSpec
from numalign.golden.fingerprint import BackgroundFingerprint, Cancelled, fingerprint_and_files

#: the module, not the function ``numalign.golden`` re-exports under its name
fingerprint_module = importlib.import_module("numalign.golden.fingerprint")


def _hashing_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "numalign-fingerprint"]


def test_the_background_fingerprint_is_the_plain_one(model_copy: Path) -> None:
    hashing = BackgroundFingerprint(model_copy)
    assert hashing.result() == fingerprint_and_files(model_copy)
    assert hashing.bytes == sum(p.stat().st_size for p in model_copy.iterdir() if p.is_file()
                                and p.name in hashing.result()[1])  # fmt: skip
    assert "of checkpoint hashed in" in hashing.throughput()


def test_a_missing_shard_is_raised_before_any_thread_starts(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"w": "model-00001-of-00002.safetensors"}}'
    )
    with pytest.raises(FileNotFoundError, match=r"model-00001-of-00002\.safetensors"):
        BackgroundFingerprint(tmp_path)
    assert _hashing_threads() == []


def test_what_the_thread_raises_the_result_raises(
    model_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreadable(*_: Any) -> Any:
        raise PermissionError("model.safetensors: permission denied")

    monkeypatch.setattr(fingerprint_module, "fingerprint_and_files", unreadable)
    hashing = BackgroundFingerprint(model_copy)
    with pytest.raises(PermissionError, match="permission denied"):
        hashing.result()


def test_cancel_stops_the_read(model_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started, release = threading.Event(), threading.Event()
    plain = fingerprint_module.fingerprint_and_files

    def slow(folder: Any, cancelled: threading.Event) -> Any:
        started.set()
        release.wait()
        return plain(folder, cancelled)

    monkeypatch.setattr(fingerprint_module, "fingerprint_and_files", slow)
    hashing = BackgroundFingerprint(model_copy)
    started.wait()
    hashing._cancelled.set()  # as cancel() does, before the read goes on
    release.set()
    with pytest.raises(Cancelled):
        hashing.result()


def test_a_failed_capture_stops_the_hashing_and_places_nothing(
    model_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("the reference could not be built")

    monkeypatch.setattr(capture_module, "load_reference", broken)
    with pytest.raises(RuntimeError, match="could not be built"):
        capture(model_copy, tmp_path / "set", CaptureSpec(long=0, far=0, progress=False))
    assert _hashing_threads() == []
    assert not (tmp_path / "set").exists()


def test_a_hash_that_fails_during_the_capture_places_no_set(
    model_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def vanished(*_: Any) -> Any:
        raise FileNotFoundError("model.safetensors: removed during the capture")

    monkeypatch.setattr(fingerprint_module, "fingerprint_and_files", vanished)
    with pytest.raises(FileNotFoundError, match="removed during the capture"):
        capture(model_copy, tmp_path / "set", CaptureSpec(long=0, far=0, progress=False))
    assert not (tmp_path / "set").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
