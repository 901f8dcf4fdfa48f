"""The cost and the gain of streamed replay (``--stream``): a full-model replay of a zoo set
with the whole model on the device against the same replay streamed (one unit of weights on
the device at a time, read from the checkpoint as the forward reaches it), side by side in
one process. Peak memory is the weights on the device: every parameter's bytes unstreamed,
the streamer's own high-water mark streamed (activations are the same both ways and left
out). Wall time is the replay's, the models already loaded (best of ``--repeat``); streamed,
it includes reading every unit from disk once per forward.
Expected: weights' peak about 1/units of the whole (the largest unit: the embedding or the
head on a tiny model), time a few times the unstreamed on the zoo's tiny models, where
reading a unit costs more than computing it.

    python bench/bench_stream.py [--set golden/sets/tiny-deep-llama] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    import torch
    from timing import best_of

    from numalign.replay.engines.transformers import TransformersEngine
    from numalign.session.settings import Settings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", default=str(ROOT / "golden" / "sets" / "tiny-deep-llama"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")

    rows = {}
    for label, stream in (("unstreamed", False), ("streamed", True)):
        engine = TransformersEngine(Settings(dtypes=(args.dtype,), stream=stream))
        engine.model(args.set, args.dtype, cpu, None)  # loads the model once
        seconds = best_of(lambda e=engine: e.model(args.set, args.dtype, cpu, None), args.repeat)
        (model,) = engine.cache.models.values()
        if stream:
            peak = model.numalign_streamer.peak_bytes
        else:
            peak = sum(p.numel() * p.element_size() for p in model.parameters())
        rows[label] = (peak, seconds)
        engine.close()

    (whole, t0), (streamed, t1) = rows["unstreamed"], rows["streamed"]
    print(f"full-model replay of {Path(args.set).name} in {args.dtype}, best of {args.repeat}")
    print(f"{'':12} {'weights peak':>14} {'wall time':>10}")
    for label, (peak, seconds) in rows.items():
        print(f"{label:12} {peak / 1024:>11.1f} KiB {seconds:>9.3f}s")
    print(f"{'ratio':12} {streamed / whole:>14.3f} {t1 / t0:>9.2f}x  (streamed / unstreamed)")


if __name__ == "__main__":
    main()
