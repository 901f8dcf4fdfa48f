"""What a manifest may hold: a field this numalign does not know is read past with a warning
naming the file and the field (the format grows by fields read with a default: a newer
numalign's additive field must not make an older one refuse the set), a missing field is an
error naming it, and a shard outside the set's own folder is refused naming the manifest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from numalign.golden import GoldenSet, GoldenSetError
from numalign.golden.manifest import GoldenFormatWarning

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def llama_set(tmp_path: Path) -> Path:
    """tiny-llama's golden set and model copied under ``tmp_path`` (tests change them)."""
    for kind in ("sets", "models"):
        shutil.copytree(ROOT / "golden" / kind / "tiny-llama", tmp_path / kind / "tiny-llama")
    return tmp_path / "sets" / "tiny-llama"


def _edit(folder: Path, change: Any) -> Path:
    manifest = folder / "manifest.json"
    data = json.loads(manifest.read_text())
    change(data)
    manifest.write_text(json.dumps(data))
    return manifest


def test_an_unknown_field_is_read_past_with_a_warning_naming_it(llama_set: Path) -> None:
    def add(data: dict[str, Any]) -> None:
        data["model"]["revision"] = "main"  # a field of a newer numalign, say
        data["future"] = {"anything": 1}
        for info in data["tensors"].values():
            info["compression"] = "none"

    manifest = _edit(llama_set, add)
    with pytest.warns(GoldenFormatWarning) as caught:
        golden = GoldenSet.open(llama_set)
    [warning] = caught
    text = str(warning.message)
    assert str(manifest) in text
    # each unknown field once, a field of every tensor as one
    assert "future, model.revision, tensors.*.compression" in text
    assert golden.model.name == "tiny-llama" and golden.points  # read as without them
    golden.verify()


def test_a_missing_field_of_an_object_is_an_error_naming_it(llama_set: Path) -> None:
    manifest = _edit(llama_set, lambda data: data["model"].pop("fingerprint"))
    with pytest.raises(GoldenSetError) as caught:
        GoldenSet.open(llama_set)
    assert str(caught.value) == (
        f"{manifest}: model has no field 'fingerprint', which format numalign.golden/4 "
        "requires; capture the set again"
    )
    assert "__init__" not in str(caught.value)


@pytest.mark.parametrize("where", ["absolute", "outside"])
def test_a_shard_outside_the_set_folder_is_refused(
    llama_set: Path, tmp_path: Path, where: str
) -> None:
    real = llama_set / "tensors-00001.safetensors"
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.copy(real, elsewhere)
    name = str(elsewhere) if where == "absolute" else "../../elsewhere.safetensors"

    def point_away(data: dict[str, Any]) -> None:
        data["shards"][name] = data["shards"].pop(real.name)
        for info in data["tensors"].values():
            info["shard"] = name

    manifest = _edit(llama_set, point_away)
    with pytest.raises(GoldenSetError) as caught:
        GoldenSet.open(llama_set)
    kind = "an absolute path" if where == "absolute" else "outside the set's folder"
    assert str(caught.value) == (
        f"{manifest}: shard {name!r} is {kind}; a set's shards are files in its own folder "
        f"({llama_set}): capture the set again, or restore its manifest"
    )


def test_a_shard_in_a_folder_of_the_set_reads(llama_set: Path) -> None:
    real = llama_set / "tensors-00001.safetensors"
    (llama_set / "shards").mkdir()
    real.rename(llama_set / "shards" / real.name)
    name = f"shards/{real.name}"

    def move(data: dict[str, Any]) -> None:
        data["shards"][name] = data["shards"].pop(real.name)
        for info in data["tensors"].values():
            info["shard"] = name

    _edit(llama_set, move)
    golden = GoldenSet.open(llama_set)
    golden.verify()
    assert golden.tensor(next(golden.keys())) is not None
