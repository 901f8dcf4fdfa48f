"""The cost of tensor-parallel replay (``--tp N``), measured side by side in one run: for
each zoo model with a tensor-parallel plan, full-model replay (every point, logits,
continuation) and the layer replay of every capture point, on one process and on a group of
N gloo ranks under torchrun (each rank one thread, as the suites run them). Prints, per
model and in all:

- warm TP replay against warm single-process replay (the model loaded, what every later test
  of a worker pays);
- what the first replay of a model pays on top of a warm one (``first +s``): for the first
  model the group's start (torchrun, imports, rendezvous: once per worker), for the others
  loading the ranks' shards.

On CPU the ranks share this machine's cores: the ratio measures what the sharding, the
collectives and the gathers cost, not a speed-up (on accelerators each rank has its own).

    python bench/bench_tp.py [--models tiny-llama tiny-qwen3-moe] [--tp 2] [--dtype float32]
        [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from timing import best_of

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_MODELS = ("tiny-llama", "tiny-deep-llama", "tiny-qwen3-moe", "tiny-gemma2")


def replay_all(path: Path, settings: Any, cache: Any, dtype: str) -> None:
    """Full-model replay and every capture point's layer replay, as the suites run them:
    each test loads its set (checked fresh) and model from the worker's cache, then replays."""
    import torch

    from numalign.replay.model import replay_layer, replay_model

    device = torch.device("cpu")
    golden, model = cache.load(path, settings, device, dtype)
    cache.run(replay_model, golden, model, dtype, device)
    for point in golden.points:
        golden, model = cache.load(path, settings, device, dtype)
        cache.run(replay_layer, golden, model, golden.point(point.name), dtype, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import torch

    from numalign.replay.model import ModelCache
    from numalign.session.settings import Settings

    torch.set_num_threads(1)
    single = Settings(device="cpu", dtypes=(args.dtype,))
    sharded = Settings(device="cpu", dtypes=(args.dtype,), tp=args.tp)
    cache = ModelCache()
    print(f"tensor-parallel replay, {args.tp} gloo ranks, {args.dtype}, best of {args.repeat}")
    print(f"{'model':<18}{'one process s':>14}{'tp s':>10}{'tp/one':>9}{'first +s':>10}")
    totals = [0.0, 0.0]
    try:
        for name in args.models:
            path = Path("golden/sets") / name
            replay_all(path, single, cache, args.dtype)  # warm: loaded, tensors read once
            one = best_of(lambda p=path: replay_all(p, single, cache, args.dtype), args.repeat)
            start = time.perf_counter()
            replay_all(path, sharded, cache, args.dtype)  # the group starts, loads, runs
            first = time.perf_counter() - start
            tp = best_of(lambda p=path: replay_all(p, sharded, cache, args.dtype), args.repeat)
            totals[0] += one
            totals[1] += tp
            print(f"{name:<18}{one:>14.3f}{tp:>10.3f}{tp / one:>8.2f}x{first - tp:>10.2f}")
    finally:
        cache.close()
    print(f"{'all':<18}{totals[0]:>14.3f}{totals[1]:>10.3f}{totals[1] / totals[0]:>8.2f}x")


if __name__ == "__main__":
    main()
