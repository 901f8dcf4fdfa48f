"""Streamed capture at depth, the small version of ``bench/bench_depth.py``: synthetic
checkpoints of one shape at 4 and 16 layers (``golden.synthetic``), each captured with
``numalign capture --stream`` in a process of its own, whose peak resident memory the
kernel reports. Streamed, the peak holds one layer's weights whatever the depth; a capture
that loaded the model whole would hold all of them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from numalign.golden import GoldenSet
from numalign.golden.stream import SHARD_INDEX
from numalign.golden.synthetic import llama_config, write_synthetic

#: The shape: 54 MB of float32 weights a layer (4 x 1024^2 attention, 3 x 1024 x 3072 MLP).
HIDDEN, INTERMEDIATE, HEADS, VOCAB = 1024, 3072, 16, 1000
LAYER_BYTES = 4 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE)
SHALLOW, DEEP = 4, 16
#: The issue's bound on peak memory at 16 layers against 4. The peak at 4 layers is the
#: interpreter with torch and transformers plus one layer's 54 MB (0.51 GiB measured); the
#: 12 more layers a whole-model capture holds add 0.65 GB. Measured on this shape
#: (2026-12-06, 2-core Xeon): 1.05x streamed, 2.03x with --no-stream, which fails here.
DEPTH_RATIO = 1.25


def _peak_capture(model_dir: Path, out: Path) -> int:
    """``numalign capture --stream`` of ``model_dir`` in its own process (one thread): its
    peak resident bytes, from the kernel's accounting of that process alone."""
    command = [
        sys.executable, "-m", "numalign.cli", "capture", str(model_dir), "--out", str(out),
        "--stream", "--calibrate", "", "--calibrate-with", "none", "--continuation", "1",
        "--decode-steps", "1", "--long", "0", "--far", "0", "--no-probes",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert process.stdout is not None
    with process.stdout:
        output = process.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(process.pid, 0)  # reaps it: Popen.wait would lose the usage
    process.returncode = os.waitstatus_to_exitcode(status)
    assert process.returncode == 0, output
    return usage.ru_maxrss * 1024  # KiB on Linux


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux only")
def test_streamed_capture_peak_memory_does_not_grow_with_depth(tmp_path: Path) -> None:
    peaks = {}
    for depth in (SHALLOW, DEEP):
        config = llama_config(depth, hidden=HIDDEN, intermediate=INTERMEDIATE, heads=HEADS,
                              vocab=VOCAB)  # fmt: skip
        model_dir = write_synthetic(config, tmp_path / f"llama-{depth}")
        out = tmp_path / "sets" / f"llama-{depth}"
        peaks[depth] = _peak_capture(model_dir, out)
        golden = GoldenSet.open(out)
        assert {p.name for p in golden.points} >= {f"model.layers.{depth - 1}.mlp"}
    assert peaks[DEEP] < DEPTH_RATIO * peaks[SHALLOW], (
        f"peak memory {peaks[DEEP] / 2**20:.0f} MiB at {DEEP} layers against "
        f"{peaks[SHALLOW] / 2**20:.0f} MiB at {SHALLOW} (a layer is {LAYER_BYTES / 2**20:.0f} MiB)"
    )


def _unit(key: str) -> str:
    layer = re.match(r"model\.layers\.\d+", key)
    return layer.group(0) if layer else key.rsplit(".", 1)[0]


def test_a_synthetic_checkpoint_is_one_unit_a_shard_the_same_every_time_and_loads(
    tmp_path: Path,
) -> None:
    def write(name: str) -> Path:
        return write_synthetic(llama_config(2, hidden=32, intermediate=64, heads=4, vocab=64),
                               tmp_path / name)  # fmt: skip

    first, second = write("a"), write("b")
    weight_map = json.loads((first / SHARD_INDEX).read_text())["weight_map"]
    units: dict[str, set[str]] = defaultdict(set)
    for key, shard in weight_map.items():
        units[shard].add(_unit(key))
    assert sorted(u for shard in units.values() for u in shard) == sorted(
        ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    )
    assert all(len(shard) == 1 for shard in units.values())
    for shard in units:
        with safe_open(str(first / shard), "pt") as a, safe_open(str(second / shard), "pt") as b:
            for key in a.keys():  # noqa: SIM118 (a safe_open is not iterable)
                assert a.get_tensor(key).equal(b.get_tensor(key)), key
    assert not list(tmp_path.glob(".*.writing"))
    model = AutoModelForCausalLM.from_pretrained(first)
    with safe_open(str(first / weight_map["lm_head.weight"]), "pt") as f:
        assert model.lm_head.weight.equal(f.get_tensor("lm_head.weight"))
