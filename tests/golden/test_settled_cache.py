"""What a process remembers about files it read: a model's fingerprint, a verified shard, an
open set. Each is reused only while the file's stat is unchanged and settled (older than
``SETTLE_S``), so a checkpoint or a set changed on disk is always seen."""

from __future__ import annotations

import os
import shutil
from importlib import import_module
from pathlib import Path
from typing import Any

import pytest

from numalign.golden import GoldenSet, StaleGoldenSetError, store

# the module (numalign.golden exports its function of the same name)
fp = import_module("numalign.golden.fingerprint")

ROOT = Path(__file__).resolve().parents[2]
LLAMA_SET = ROOT / "golden" / "sets" / "tiny-llama"


@pytest.fixture
def set_copy(tmp_path: Path) -> Path:
    """tiny-llama's golden set copied under ``tmp_path`` (only its model path, relative, no
    longer resolves: these tests never check it fresh)."""
    folder = tmp_path / "set"
    shutil.copytree(LLAMA_SET, folder)
    return folder


def counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Counts the calls of ``module.name`` (still calling it)."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def rewrite_same_size(path: Path) -> None:
    """Changes one byte of ``path``'s last 64 (tensor data, not the safetensors header)
    keeping its size, and moves its modification time, as an in-place edit would."""
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01
    path.write_bytes(bytes(data))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))


def test_a_settled_model_is_hashed_once(monkeypatch: pytest.MonkeyPatch, model_copy: Path) -> None:
    monkeypatch.setattr(fp, "SETTLE_S", 0.0)  # the copy just made counts as settled
    hashed = counting(monkeypatch, fp, "fingerprint_and_files")
    first = fp.fingerprint(model_copy)
    assert fp.fingerprint(model_copy) == first
    assert len(hashed) == 1
    rewrite_same_size(model_copy / "model.safetensors")
    changed = fp.fingerprint(model_copy)
    assert changed != first and len(hashed) == 2
    assert changed == fp.fingerprint_and_files(model_copy)[0]


def test_a_recently_changed_model_is_hashed_every_time(
    monkeypatch: pytest.MonkeyPatch, model_copy: Path
) -> None:
    # an hour: every file counts as just written, its stat not trusted (a rewrite within
    # one timestamp tick would keep it)
    monkeypatch.setattr(fp, "SETTLE_S", 3600.0)
    hashed = counting(monkeypatch, fp, "fingerprint_and_files")
    fp.fingerprint(model_copy)
    fp.fingerprint(model_copy)
    assert len(hashed) == 2


def test_a_set_goes_stale_when_its_model_changes_after_a_cached_check(
    monkeypatch: pytest.MonkeyPatch, model_copy: Path
) -> None:
    monkeypatch.setattr(fp, "SETTLE_S", 0.0)
    golden = GoldenSet.open(LLAMA_SET)
    golden.check_fresh(model_copy)
    golden.check_fresh(model_copy)  # from the process's memory
    rewrite_same_size(model_copy / "model.safetensors")
    with pytest.raises(StaleGoldenSetError, match=r"model.safetensors \(changed\)"):
        golden.check_fresh(model_copy)


def test_a_verified_shard_is_hashed_again_only_when_it_changed(
    monkeypatch: pytest.MonkeyPatch, set_copy: Path
) -> None:
    monkeypatch.setattr(fp, "SETTLE_S", 0.0)
    folder = set_copy
    golden = GoldenSet.open(folder)
    shard = next(iter(golden.manifest.shards))
    hashed = counting(monkeypatch, store, "sha256_file")
    golden.verify_shard(shard)
    golden.verify_shard(shard)
    assert len(hashed) == 1
    rewrite_same_size(folder / shard)
    with pytest.raises(store.GoldenSetError, match="does not match the manifest"):
        golden.verify_shard(shard)
    monkeypatch.setattr(fp, "SETTLE_S", 3600.0)  # unsettled: hashed on every check
    shutil.copy2(LLAMA_SET / shard, folder / shard)
    golden.verify_shard(shard)
    golden.verify_shard(shard)
    assert len(hashed) == 4


def test_a_shared_set_is_opened_again_when_its_manifest_is_replaced(
    monkeypatch: pytest.MonkeyPatch, set_copy: Path
) -> None:
    monkeypatch.setattr(fp, "SETTLE_S", 0.0)
    folder = set_copy
    first = GoldenSet.open_shared(folder)
    assert GoldenSet.open_shared(folder) is first
    calibration = first.calibration("float32")
    first.write_calibration("float16", calibration)  # the manifest replaced by rename
    again = GoldenSet.open_shared(folder)
    assert again is not first
    assert again.calibration("float16") == calibration
    monkeypatch.setattr(fp, "SETTLE_S", 3600.0)  # a manifest just written is never shared
    assert GoldenSet.open_shared(folder) is not GoldenSet.open_shared(folder)
