"""Sharded checkpoints (several safetensors shards and ``model.safetensors.index.json``, as
``save_pretrained(max_shard_size=...)`` writes them): capture gives the golden values of the
single-file checkpoint; the fingerprint covers every shard and the index; a missing or
changed shard is named in the error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from numalign.golden import GoldenSet, StaleGoldenSetError
from numalign.golden.capture import capture
from numalign.golden.capture_spec import CaptureSpec
from numalign.golden.fingerprint import fingerprint
from numalign.golden.reference import load_model

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "golden" / "models" / "tiny-llama"
ZOO_SET = ROOT / "golden" / "sets" / "tiny-llama"
#: the capture these tests need: the prompts' forward alone
QUICK = CaptureSpec(continuation=0, decode_steps=0, long=0, progress=False)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GoldenSet]:
    root = tmp_path_factory.mktemp("sharded")
    folder = root / "models" / "sharded-llama"
    model = load_model(LLAMA, "float32", attn_implementation="eager", trust_remote_code=False)
    # 300 KB shards: the 1.4 MB tiny-llama becomes several shards and an index
    model.save_pretrained(folder, max_shard_size="300KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (LLAMA / name).is_file():
            shutil.copy(LLAMA / name, folder / name)
    golden = capture(folder, root / "sets" / "sharded-llama", QUICK)
    return folder, golden


def shards_of(folder: Path) -> list[str]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))


def test_a_sharded_checkpoint_captures_the_values_of_the_single_file_one(
    sharded: tuple[Path, GoldenSet],
) -> None:
    folder, golden = sharded
    shards = shards_of(folder)
    assert len(shards) > 1
    assert set(golden.model.files) == {
        "config.json", "model.safetensors.index.json", *shards,
    }  # fmt: skip
    golden.check_fresh()
    zoo = GoldenSet.open(ZOO_SET)
    for request in ("text-leftpad", "text-rightpad"):
        mine = golden.tensor(golden.final_outputs(request)["logits"])
        theirs = zoo.tensor(zoo.final_outputs(request)["logits"])
        assert torch.equal(mine, theirs)  # the same weights, the same computation: bit for bit


def test_the_fingerprint_covers_every_shard_and_the_index(
    sharded: tuple[Path, GoldenSet], tmp_path: Path
) -> None:
    folder, _ = sharded
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    before = fingerprint(copy)
    for name in [*shards_of(copy), "model.safetensors.index.json"]:
        path = copy / name
        data = path.read_bytes()
        # a shard's last byte flipped (a weight's); the index (JSON) one space longer
        changed = data + b" " if name.endswith(".json") else data[:-1] + bytes([data[-1] ^ 1])
        path.write_bytes(changed)
        assert fingerprint(copy) != before, name
        path.write_bytes(data)
    assert fingerprint(copy) == before


def test_a_missing_or_changed_shard_is_named(
    sharded: tuple[Path, GoldenSet], tmp_path: Path
) -> None:
    folder, golden = sharded
    copy = tmp_path / "models" / "sharded-llama"
    shutil.copytree(folder, copy)
    first, second = shards_of(copy)[:2]
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(copy / first))
    name = next(iter(tensors))
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, str(copy / first), metadata={"format": "pt"})
    with pytest.raises(StaleGoldenSetError, match=rf"\({first} \(changed\)\): run numalign"):
        golden.check_fresh(copy)
    (copy / second).unlink()
    with pytest.raises(StaleGoldenSetError, match=rf"{second} \(missing\)"):
        golden.check_fresh(copy)
    with pytest.raises(FileNotFoundError, match=rf"{second}: a shard the checkpoint's index"):
        capture(copy, tmp_path / "sets" / "broken", QUICK)
    assert not (tmp_path / "sets" / "broken").exists()  # nothing half-written
