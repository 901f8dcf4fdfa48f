"""Capture costs on a mid-size model (hidden 1024, 8 layers, 512 tokens), as ratios from one
run:

- capture with writing over a plain forward (target 2.0x or less);
- peak RSS of a capture over the model's working set (the peak RSS of a plain forward of the
  same requests) plus two layers of captured tensors (target 1.5x or less); each peak is
  measured in a fresh interpreter (VmHWM above the RSS once torch is imported), since Linux
  carries a parent's peak into a child's ru_maxrss;
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

COMMON = r"""
import json, sys, time, torch, transformers
from pathlib import Path
import numalign.golden.requests as requests
requests.SEEDED_LENGTHS = (512, 512)  # 2 x 512 tokens (no tokenizer in this folder)
torch.set_num_threads(1)
folder, out = sys.argv[1], sys.argv[2]

def status(field):  # bytes, from this process's own counters (fresh after exec)
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)

rss0 = status("VmRSS")  # torch and transformers imported, nothing else yet
"""
#: A fresh process: the model loaded and run once (warm-up), then timed; its peak RSS.
FORWARD = (
    COMMON
    + r"""
from numalign.golden.reference import load_model
model = load_model(Path(folder), "float32", attn_implementation="eager", trust_remote_code=False)
req = requests.text_requests(Path(folder), model.config, [], False)[0]
with torch.no_grad():
    model(**req.inputs, use_cache=False)
    start = time.perf_counter()
    model(**req.inputs, use_cache=False)
    forward = time.perf_counter() - start
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"forward_s": forward, "peak": status("VmHWM") - rss0,
                  "model_bytes": model_bytes}))
"""
)
#: Another fresh process: the capture alone; its peak RSS.
CAPTURE = (
    COMMON
    + r"""
from numalign.golden.capture import capture
from numalign.golden.capture_spec import CaptureSpec
start = time.perf_counter()
golden = capture(folder, out, CaptureSpec(continuation=0, progress=False))
capture_s = time.perf_counter() - start
per_request = golden.unique_tensor_bytes() / len(golden.requests)
layers = sum(1 for p in golden.points if p.type.endswith("DecoderLayer"))
print(json.dumps({"capture_s": capture_s, "requests": len(golden.requests),
                  "peak": status("VmHWM") - rss0, "layer_bytes": per_request / max(1, layers)}))
"""
)


def child(code: str, *args: str) -> dict[str, float]:
    """Runs ``code`` in a fresh interpreter (its peak RSS is its own: a parent's is not
    carried in, as ru_maxrss would carry it) and returns the JSON it prints last."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         check=True)  # fmt: skip
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


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
    from numalign.golden.shards import ShardWriter
    from numalign.golden.store import write_manifest

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
        f = child(FORWARD, str(model), "")
        c = child(CAPTURE, str(model), str(tmp / "set"))
        capture_ratio = c["capture_s"] / (f["forward_s"] * c["requests"])
        # what capture adds to the model's own working set (its forward's peak)
        rss_ratio = c["peak"] / (f["peak"] + 2 * c["layer_bytes"])
        raw_ratio = c["peak"] / (f["model_bytes"] + 2 * c["layer_bytes"])
        forward_ratio = f["peak"] / f["model_bytes"]
        small, large = tmp / "small", tmp / "large"
        synthetic_set(small, 10 << 20)
        synthetic_set(large, 1 << 30)
        t_small, t_large = load_time(small, "t1"), load_time(large, "t1")
        print("model: hidden 1024, 8 layers, 2 requests of 512 tokens")
        print(f"capture / plain forward:            {capture_ratio:6.2f}x  (target <= 2.0x)")
        print(f"plain forward's peak RSS / model:   {forward_ratio:6.2f}x  (eager attention, 512)")
        print(f"capture peak / (forward peak + 2 layers): {rss_ratio:6.2f}x  (target <= 1.5x)")
        print(f"capture peak / (model + 2 layers):  {raw_ratio:6.2f}x  (the forward's own share)")
        print(f"load one point, 1 GB set / 10 MB:   {t_large / t_small:6.2f}x  (target <= 2x)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
