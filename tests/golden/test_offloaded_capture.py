"""Capture larger than memory: ``numalign capture --device-map auto --offload-folder DIR``
(accelerate's big-model loading through from_pretrained) captures with the weights offloaded
to disk, module by module, and writes the same golden set as an in-memory capture, bit for
bit. Misused options are errors that say how to use them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from numalign.golden import GoldenSet
from numalign.golden.capture import capture
from numalign.golden.capture_spec import CaptureSpec
from numalign.golden.reference import Placement, load_model, parse_max_memory

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "golden" / "models" / "tiny-llama"
#: Memory the offloaded capture may use for weights: less than one of tiny-llama's layers
#: (about 130 KB in float32), so every module but what accelerate must keep goes to disk.
TINY_BUDGET = "cpu=50KB"


def test_weights_past_the_memory_budget_go_to_disk(tmp_path: Path) -> None:
    placement = Placement("auto", tmp_path / "offload", parse_max_memory(TINY_BUDGET))
    model = load_model(LLAMA, "float32", attn_implementation="eager", trust_remote_code=False,
                       placement=placement)  # fmt: skip
    assert "disk" in set(model.hf_device_map.values())


def test_an_offloaded_capture_is_the_in_memory_capture_bit_for_bit(tmp_path: Path) -> None:
    in_memory = capture(LLAMA, tmp_path / "memory", CaptureSpec(progress=False))
    command = [
        sys.executable, "-m", "numalign.cli", "capture", str(LLAMA), "--out",
        str(tmp_path / "offloaded"), "--calibrate", "bfloat16", "--device-map", "auto",
        "--offload-folder", str(tmp_path / "offload"), "--max-memory", TINY_BUDGET,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    offloaded = GoldenSet.open(tmp_path / "offloaded")
    assert offloaded.manifest.tensors.keys() == in_memory.manifest.tensors.keys()
    for key in in_memory.manifest.tensors:
        assert torch.equal(offloaded.tensor(key), in_memory.tensor(key)), key
    assert offloaded.manifest.points == in_memory.manifest.points
    assert offloaded.manifest.decode == in_memory.manifest.decode
    assert offloaded.model.fingerprint == in_memory.model.fingerprint
    # calibrated offloaded too (its own model loaded the same way)
    assert offloaded.calibrated("bfloat16", "model.layers.0", "0", "isolated") is not None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--offload-folder", "x"], "place a model with --device-map"),
        (["--device-map", "auto", "--max-memory", "cpu"], "write DEVICE=SIZE pairs"),
    ],
)
def test_misused_placement_options_say_how(
    tmp_path: Path, options: list[str], message: str
) -> None:
    command = [sys.executable, "-m", "numalign.cli", "capture", str(LLAMA), "--out",
               str(tmp_path / "set"), *options]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode != 0 and message in done.stderr
    assert not (tmp_path / "set").exists()
