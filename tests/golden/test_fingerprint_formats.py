"""The fingerprint covers every file a checkpoint loads from, whatever its format, and a
remote-code model's modules (a changed pytorch_model.bin was once "fresh")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from numalign.golden.fingerprint import fingerprint, fingerprint_and_files, missing_shards


def _as_bin(model: Path) -> Path:
    """The model folder with its weights as PyTorch's pickle checkpoint, as older
    save_pretrained calls wrote it."""
    from safetensors.torch import load_file

    tensors = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    torch.save(tensors, model / "pytorch_model.bin")
    return model / "pytorch_model.bin"


def test_a_bin_checkpoint_is_in_the_fingerprint_and_a_change_is_named(model_copy: Path) -> None:
    weights = _as_bin(model_copy)
    digest, files = fingerprint_and_files(model_copy)
    assert "pytorch_model.bin" in files
    tensors = torch.load(weights, weights_only=True)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.05
    torch.save(tensors, weights)
    assert fingerprint_and_files(model_copy)[0] != digest


@pytest.mark.parametrize(
    "name", ["model.pt", "model.pth", "model.gguf", "modeling_custom.py", "configuration_x.py"]
)
def test_other_weight_formats_and_remote_code_change_the_fingerprint(
    model_copy: Path, name: str
) -> None:
    before = fingerprint(model_copy)
    (model_copy / name).write_bytes(b"weights or code")
    assert fingerprint(model_copy) != before
    assert name in fingerprint_and_files(model_copy)[1]


def test_a_bin_index_names_its_missing_shards(model_copy: Path) -> None:
    index = {"weight_map": {"a": "pytorch_model-00001-of-00002.bin"}}
    (model_copy / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert missing_shards(model_copy) == ["pytorch_model-00001-of-00002.bin"]
    with pytest.raises(FileNotFoundError, match=r"a shard the checkpoint's index names"):
        fingerprint_and_files(model_copy)


def test_a_checkpoint_pickling_objects_is_a_clear_error(tmp_path: Path, model_copy: Path) -> None:
    """Issue 27, item 11: an unsupported pickle gave torch's raw traceback."""
    import fractions

    from numalign.golden.capture import capture
    from numalign.golden.capture_spec import CaptureSpec

    weights = _as_bin(model_copy)
    tensors = torch.load(weights, weights_only=True)
    torch.save({**tensors, "extra": fractions.Fraction(1, 3)}, weights)
    with pytest.raises(ValueError, match=r"holds objects that are not plain tensors .*"
                       r"Fraction.*never unpickles them. Convert it to safetensors"):  # fmt: skip
        capture(model_copy, tmp_path / "set",
                CaptureSpec(continuation=0, decode_steps=0, long=0, progress=False))  # fmt: skip
    assert not (tmp_path / "set").exists()
