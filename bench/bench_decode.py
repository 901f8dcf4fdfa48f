"""The cost of decode replay: per golden set, a decode replay with a KV cache (prefill, then
each golden step with every point compared, the logits judged, the cache's contents compared)
against a plain cached decode of the same model, requests and tokens (prefill and the same
steps, nothing observed), measured side by side in one process; the paged engine's replay
beside them; and the golden bytes each decode step adds to a set.
Target: decode replay at most 3x a plain cached decode step.

    python bench/bench_decode.py [--sets golden/sets] [--dtype bfloat16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def plain_decode(golden: Any, model: Any, dtype: Any) -> int:
    """The golden requests' prefill and steps with a dynamic cache, nothing observed; returns
    the number of decode steps run."""
    import torch

    from numalign.golden.reference import decode_inputs, new_cache, prefill_kwargs

    steps = 0
    for request in golden.decode_requests:
        decode = golden.decode(request)
        inputs = {
            k: golden.tensor(v, dtype=dtype) for k, v in golden.request(request).inputs.items()
        }
        tokens = [golden.tensor(s.token) for s in decode.steps]
        cache = new_cache(model, "dynamic", inputs["input_ids"].shape[1] + len(tokens))
        with torch.no_grad():
            model(**inputs, **prefill_kwargs(model, inputs, cache))
            for token in tokens:
                inputs, forward = decode_inputs(model, inputs, token, cache)
                model(**forward)
        steps += len(tokens)
    return steps


def step_bytes(golden: Any) -> tuple[int, int, int]:
    """(bytes of every decode step's tensors, bytes of the cache snapshots, steps), each
    tensor counted once as the store keeps it."""
    info = golden.manifest.tensors
    step_keys: set[str] = set()
    cache_keys: set[str] = set()
    steps = 0
    for request in golden.decode_requests:
        decode = golden.decode(request)
        steps += len(decode.steps)
        for step in decode.steps:
            step_keys |= {step.token, step.logits}
            step_keys |= {k for calls in step.points.values() for c in calls for k in c.values()}
        cache_keys |= set(decode.prefill_cache.values()) | set(decode.final_cache.values())
    return (
        sum(info[k].bytes for k in step_keys),
        sum(info[k].bytes for k in cache_keys - step_keys),
        steps,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sets", default="golden/sets")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=3, help="best of N timings")
    args = parser.parse_args()

    import torch

    from numalign.golden.store import discover_sets
    from numalign.replay.decode import replay_decode
    from numalign.replay.model import ModelCache
    from numalign.replay.paged import PagedUnsupported
    from numalign.replay.serving import _paged_model
    from numalign.session.settings import Settings

    torch.set_num_threads(1)
    device, settings, cache = torch.device("cpu"), Settings(), ModelCache()
    dtype = getattr(torch, args.dtype)
    totals = {"plain": 0.0, "replay": 0.0}
    print(f"{'set':18} {'steps':>5} {'plain/step':>11} {'replay/step':>12} {'ratio':>6} "
          f"{'paged/step':>11} {'KB/step':>8} {'cache KB':>9}")  # fmt: skip
    for path in discover_sets([Path(args.sets)]):
        golden, model = cache.load(path, settings, device, args.dtype)
        if not golden.decode_requests:
            continue
        plain_decode(golden, model, dtype)  # warm: first calls allocate
        replay_decode(golden, model, args.dtype, device, "dynamic")
        plain = replay = paged = float("inf")
        steps = 0
        for _ in range(args.repeat):
            start = time.perf_counter()
            steps = plain_decode(golden, model, dtype)
            plain = min(plain, time.perf_counter() - start)
            start = time.perf_counter()
            replay_decode(golden, model, args.dtype, device, "dynamic")
            replay = min(replay, time.perf_counter() - start)
        try:
            served = _paged_model(cache, golden, settings, device, args.dtype)
            start = time.perf_counter()
            replay_decode(golden, served, args.dtype, device, "paged")
            paged = time.perf_counter() - start
        except PagedUnsupported:
            pass
        totals["plain"] += plain
        totals["replay"] += replay
        step_b, cache_b, counted = step_bytes(golden)
        per_step = [1e3 * t / steps for t in (plain, replay, paged)]
        print(f"{golden.name:18} {steps:5d} {per_step[0]:9.1f}ms {per_step[1]:10.1f}ms "
              f"{replay / plain:5.2f}x {per_step[2]:9.1f}ms {step_b / counted / 1e3:8.1f} "
              f"{cache_b / 1e3:9.1f}")  # fmt: skip
    ratio = totals["replay"] / totals["plain"]
    print(f"decode replay / plain cached decode, all sets: {ratio:.2f}x (target <= 3)")


if __name__ == "__main__":
    main()
