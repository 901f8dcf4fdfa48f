"""The cost of verifying golden data before replay uses it: the sha256 of every shard of the
zoo's sets (once per process and set, as replay does) against a layer replay of every point
of those sets in bfloat16, measured side by side in one process.
Target: verification at most 10% of the layer replay.

    python bench/bench_verify.py [--sets golden/sets]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sets", default="golden/sets")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    import torch

    from numalign.golden import store
    from numalign.golden.store import discover_sets
    from numalign.replay.model import ModelCache, replay_layer
    from numalign.session.settings import Settings

    torch.set_num_threads(1)
    device = torch.device("cpu")
    cache, settings = ModelCache(), Settings()
    verify_s = replay_s = 0.0
    shards = 0
    for path in discover_sets([Path(args.sets)]):
        golden, model = cache.load(path, settings, device, args.dtype)
        store._VERIFIED.clear()  # cold: as the first test of a worker finds it
        start = time.perf_counter()
        for name in golden.manifest.shards:
            golden.verify_shard(name)
            shards += 1
        verify_s += time.perf_counter() - start
        start = time.perf_counter()  # warm: what every later read of the set costs
        for point in golden.points:
            replay_layer(golden, model, point, args.dtype, device)
        replay_s += time.perf_counter() - start
    print(f"shards verified: {shards}")
    print(f"verification: {verify_s:.3f} s, layer replay: {replay_s:.3f} s")
    print(f"verification / layer replay: {verify_s / replay_s:.3f}x (target <= 0.10)")


if __name__ == "__main__":
    main()
