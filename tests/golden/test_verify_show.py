"""``golden verify`` checks everything the suites rely on, ``golden show`` and ``golden ls``
never die on a bad set, and shards are as readable as manifests."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest

from numalign.cli import main
from numalign.golden import GoldenSet, GoldenSetError
from numalign.golden.capture import capture
from numalign.golden.capture_spec import CaptureSpec


@pytest.fixture
def golden(tmp_path: Path, model_copy: Path) -> GoldenSet:
    spec = CaptureSpec(continuation=0, decode_steps=0, long=0, progress=False)
    return capture(model_copy, tmp_path / "sets" / "llama", spec)


def _edit_manifest(golden: GoldenSet, edit: object) -> None:
    path = golden.path / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)  # type: ignore[operator]
    path.write_text(json.dumps(data))


def _first_float(data: dict) -> str:  # type: ignore[type-arg]
    return next(k for k, v in data["tensors"].items() if v["dtype"] == "float32")


@pytest.mark.parametrize(
    ("lie", "message"),
    [
        (lambda d: d["tensors"][_first_float(d)].update(dtype="float16"), r"where the manifest"),
        (lambda d: d["tensors"][_first_float(d)].update(shape=[3, 7]), r"where the manifest"),
        (
            lambda d: d["tensors"].update({"ghost/out/0": {**d["tensors"][_first_float(d)]}}),
            r"tensor 'ghost/out/0' is missing",
        ),
    ],
    ids=["dtype", "shape", "absent tensor"],
)
def test_verify_refuses_a_manifest_that_lies_about_its_tensors(
    golden: GoldenSet, lie: object, message: str
) -> None:
    _edit_manifest(golden, lie)
    GoldenSet.open(golden.path).verify()  # the checksums alone pass: the false green
    with pytest.raises(GoldenSetError, match=message):
        GoldenSet.open(golden.path).verify(contents=True)
    assert main(["golden", "verify", str(golden.path)]) == 1


def test_verify_refuses_header_offsets_out_of_range_under_a_matching_checksum(
    golden: GoldenSet,
) -> None:
    shard = golden.path / "tensors-00001.safetensors"
    data = bytearray(shard.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    # the tensor that ends last, its end moved past the end of the file with as many digits
    # (all nines: the last end has about the file's digits), so the header keeps its size
    key = max((k for k in header if k != "__metadata__"),
              key=lambda k: header[k]["data_offsets"][1])  # fmt: skip
    end = header[key]["data_offsets"][1]
    header[key]["data_offsets"][1] = int("9" * len(str(end)))
    assert header[key]["data_offsets"][1] > len(data) - 8 - size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (size - len(text))
    assert len(text) == size, "the forged header must keep its size"
    shard.write_bytes(bytes(data[:8]) + text + bytes(data[8 + size :]))
    digest = hashlib.sha256(shard.read_bytes()).hexdigest()
    _edit_manifest(golden, lambda d: d["shards"]["tensors-00001.safetensors"].update(
        sha256=digest))  # fmt: skip
    with pytest.raises(GoldenSetError, match=r"tensors-00001.safetensors: unreadable"):
        GoldenSet.open(golden.path).verify(contents=True)


def test_shards_are_as_readable_as_the_manifest(golden: GoldenSet) -> None:
    mode = stat.S_IMODE((golden.path / "manifest.json").stat().st_mode)
    for shard in golden.path.glob("tensors-*.safetensors"):
        assert stat.S_IMODE(shard.stat().st_mode) == mode, oct(shard.stat().st_mode)


def test_show_never_raises_on_a_tensor_the_manifest_lacks(
    golden: GoldenSet, capsys: pytest.CaptureFixture[str]
) -> None:
    def drop(d: dict) -> None:  # type: ignore[type-arg]
        key = next(iter(d["points"][0]["calls"].values()))[0]["outputs"]
        del d["tensors"][next(iter(key.values()))]

    _edit_manifest(golden, drop)
    assert main(["golden", "show", str(golden.path)]) == 0
    assert "MISSING from the manifest" in capsys.readouterr().out


def test_ls_lists_past_a_broken_set_and_refuses_a_missing_folder(
    golden: GoldenSet, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = golden.path.with_name("broken")
    broken.mkdir()
    (broken / "manifest.json").write_text("{")
    assert main(["golden", "ls", str(golden.path.parent)]) == 1
    out = capsys.readouterr().out
    assert "broken                   BROKEN: " in out and "not valid JSON" in out
    assert "llama " in out and "fresh" in out
    assert main(["golden", "ls", str(golden.path.parent / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err
