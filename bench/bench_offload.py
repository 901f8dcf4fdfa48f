"""Peak memory of a capture with the weights offloaded to disk (``numalign capture
--device-map auto --offload-folder DIR --max-memory cpu=SIZE``) against the weights' size,
beside an in-memory capture of the same model, measured in one run. Each capture runs in its
own process (its peak resident set, VmHWM; Linux). The same offloaded capture of the zoo's
1.4 MB tiny-llama gives the fixed cost every capture pays whatever the model's size (torch,
transformers and the model code imported, the loader's buffers), which the ratios leave out
(``peak - tiny``); the totals are printed too.

The model is built here from a config (random weights, a few hundred MB: a Llama of hidden
1024 and 8 layers, about 170 M parameters, 0.68 GB in float32) and captured without
calibration (``--calibrate ''``), so the capture's own footprint is measured. Target: the
offloaded capture at most 0.5x the weights.

    python bench/bench_offload.py [--hidden 1024] [--layers 8] [--max-memory cpu=64MB]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Run in a child process: the capture (or nothing), then the process's peak RSS in bytes
#: (VmHWM: this process image's own high-water mark; ru_maxrss would carry the parent's
#: over fork).
CHILD = """
import sys
import torch, transformers
import numalign.golden.capture, numalign.replay.calibrate
from numalign.cli import main
if sys.argv[1:]:
    main(sys.argv[1:])
status = open("/proc/self/status").read().split("VmHWM:")[1].split()
print("PEAK", int(status[0]) * 1024)
"""


def peak_rss(*args: str) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise SystemExit(f"bench_offload: {' '.join(args[:1])} failed:\n{done.stderr[-3000:]}")
    return int(done.stdout.split("PEAK")[-1])


def build_model(folder: Path, hidden: int, layers: int) -> int:
    """A random Llama saved as safetensors in ``folder``, with the zoo's tokenizer; its
    weights' size in bytes."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    zoo = Path(__file__).resolve().parents[1] / "golden" / "models" / "tiny-llama"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (zoo / name).is_file():
            shutil.copy(zoo / name, folder / name)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-memory", default="cpu=64MB")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="numalign-bench-offload-") as tmp:
        root = Path(tmp)
        weights = build_model(root / "model", args.hidden, args.layers)
        capture = ["capture", str(root / "model"), "--calibrate", "", "--decode-steps", "2"]
        zoo = Path(__file__).resolve().parents[1] / "golden" / "models" / "tiny-llama"
        fixed = peak_rss(
            "capture", str(zoo), "--calibrate", "", "--decode-steps", "2", "--out",
            str(root / "tiny"), "--device-map", "auto", "--offload-folder",
            str(root / "offload-tiny"), "--max-memory", args.max_memory,
        )  # fmt: skip
        memory = peak_rss(*capture, "--out", str(root / "memory"))
        offloaded = peak_rss(
            *capture, "--out", str(root / "offloaded"), "--device-map", "auto",
            "--offload-folder", str(root / "offload"), "--max-memory", args.max_memory,
        )  # fmt: skip
    gb = 1e9
    print(f"weights {weights / gb:.3f} GB; the same capture of the 1.4 MB zoo tiny-llama "
          f"peaks at {fixed / gb:.3f} GB")  # fmt: skip
    print(f"{'capture':<28}{'peak GB':>9}{'peak - tiny':>13}{'/ weights':>11}")
    for label, peak in (("in memory", memory), (f"offloaded ({args.max_memory})", offloaded)):
        above = peak - fixed
        print(f"{label:<28}{peak / gb:>9.3f}{above / gb:>13.3f}{above / weights:>10.2f}x")
    print("target: offloaded (peak - tiny) / weights <= 0.5x")


if __name__ == "__main__":
    main()
