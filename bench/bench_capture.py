"""Capture costs on a mid-size model (hidden 1024, 8 layers, 512 tokens), as ratios from one
run:

- capture with writing over a plain forward (target 2.0x or less);
- peak RSS during capture, above the process before the model was loaded, over the model's
  own size plus two layers of captured tensors (target 1.5x or less);
- the time to load one point from a 1 GB set over a 10 MB set (target 2x or less: lazy
  loading does not grow with the set).

    python bench/bench_capture.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time, torch, transformers
from pathlib import Path
from numalign.golden.capture import capture
from numalign.golden.reference import load_model
from numalign.golden.requests import text_requests
torch.set_num_threads(1)
folder, out = sys.argv[1], sys.argv[2]

def status(field):  # kB -> bytes, from this process's own counters (fresh after exec)
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)

rss0 = status("VmRSS")  # torch and transformers imported, no model yet
model = load_model(Path(folder), "float32", attn_implementation=None, trust_remote_code=False)
req = text_requests(Path(folder), model.config, [], False)[0]
with torch.no_grad():
    model(**req.inputs, use_cache=False)  # warm-up
    start = time.perf_counter()
    model(**req.inputs, use_cache=False)
    forward = time.perf_counter() - start
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
del model
start = time.perf_counter()
golden = capture(folder, out, continuation=0, progress=False)
capture_s = time.perf_counter() - start
peak = status("VmHWM")
per_request = golden.unique_tensor_bytes() / len(golden.requests)
layers = sum(1 for p in golden.points if p.type.endswith("DecoderLayer"))
print(json.dumps({"forward_s": forward, "capture_s": capture_s, "requests": len(golden.requests),
                  "rss0": rss0, "peak": peak, "model_bytes": model_bytes,
                  "layer_bytes": per_request / max(1, layers)}))
"""


MAKE_MODEL = r"""
import sys, torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024,
)
transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1])
"""


def make_model(folder: Path) -> None:
    """The benchmark model, built in its own process: the measuring process must start small
    (Linux carries a parent's peak RSS into ru_maxrss, which made an earlier figure 0.49x)."""
    subprocess.run([sys.executable, "-c", MAKE_MODEL, str(folder)], check=True)


def synthetic_set(folder: Path, total_bytes: int) -> None:
    """A golden set of ``total_bytes`` of 4 MB tensors, written with the capture's sink."""
    import torch

    from numalign.golden.manifest import Manifest, ModelInfo, ReferenceInfo
    from numalign.golden.store import ShardWriter, write_manifest

    folder.mkdir(parents=True)
    writer = ShardWriter(folder, max_shard_bytes=256 << 20)
    count = max(1, total_bytes // (4 << 20))
    for i in range(count):
        writer.put(f"t{i}", torch.full((1 << 20,), float(i)))
    writer.flush()
    manifest = Manifest(
        model=ModelInfo("model", "model", "none", None, "sha256:0"),
        reference=ReferenceInfo("cpu", "float32", None, "", ""),
        requests=[], points=[], tensors=writer.tensors, shards=writer.shards,
    )  # fmt: skip
    write_manifest(folder, manifest)


def load_time(folder: Path, key: str, repeats: int = 20) -> float:
    """Best time to load one point's tensor from an open set (a worker opens a set once and
    loads points from it), bytes brought into memory: a clone touches every page of the
    memory-mapped shard, as a replay does."""
    from numalign.golden import GoldenSet

    golden = GoldenSet.open(folder)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        golden.tensor(key).clone()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="numalign-bench-"))
    try:
        model = tmp / "model"
        make_model(model)
        # 512 tokens: two prompts of 512 seeded ids (no tokenizer in this folder)
        env_code = "import numalign.golden.requests as r; r.SEEDED_LENGTHS = (512, 512)\n" + CHILD
        out = subprocess.run([sys.executable, "-c", env_code, str(model), str(tmp / "set")],
                             capture_output=True, text=True, check=True)  # fmt: skip
        r = json.loads(out.stdout.strip().splitlines()[-1])
        capture_ratio = r["capture_s"] / (r["forward_s"] * r["requests"])
        rss_ratio = (r["peak"] - r["rss0"]) / (r["model_bytes"] + 2 * r["layer_bytes"])
        small, large = tmp / "small", tmp / "large"
        synthetic_set(small, 10 << 20)
        synthetic_set(large, 1 << 30)
        t_small, t_large = load_time(small, "t1"), load_time(large, "t1")
        print("model: hidden 1024, 8 layers, 2 requests of 512 tokens")
        print(f"capture / plain forward:            {capture_ratio:6.2f}x  (target <= 2.0x)")
        print(f"peak RSS / (model + 2 layers):      {rss_ratio:6.2f}x  (target <= 1.5x)")
        print(f"load one point, 1 GB set / 10 MB:   {t_large / t_small:6.2f}x  (target <= 2x)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
