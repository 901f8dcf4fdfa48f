"""The cost of replay through vLLM: per golden set and dtype, the engine's replay serving
(every row of every request, decode rows teacher-forced, hooks reading every mapped point and
the logits at every position) against a plain ``LLM.generate`` of the same requests and token
counts on the same engine (nothing observed, greedy), measured side by side in one process,
for the prefill alone (one token per request) and for prefill plus the decode steps.
Target: replay at most 3x plain serving on SmolLM2-sized models, where the forward dominates.
The engine starts once per set and dtype (its start-up is reported, not in the ratios).

Run in the environment that has vLLM (see docs/vllm.md):

    python bench/bench_vllm.py [--sets golden/sets] [--names tiny-mistral] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from timing import best_of


def plain(engine: Any, golden: Any, decode: bool) -> None:
    """The golden rows served as a user would: same prompts and token counts, no hooks,
    nothing forced."""
    from numalign.replay.engines.vllm_serving import row_requests

    prompts, params = row_requests(golden, decode, observed=False)
    engine._running.llm.generate(prompts, params, use_tqdm=False)


def replay(engine: Any, golden: Any, decode: bool) -> None:
    """The replay's serving: every row, hooks on every mapped point, decode rows forced
    (with ``decode`` False the decode requests' steps are dropped: the prefill alone)."""
    from numalign.replay.engines.vllm_serving import serve_rows
    from numalign.runtime.serving import ARRANGEMENTS, DEFAULT_SERVING

    serve_rows(engine._running, golden, ARRANGEMENTS[DEFAULT_SERVING], decode=decode)


def set_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a benchmark that serves golden sets through vLLM: which sets, the
    dtype, runs per measurement."""
    parser.add_argument("--sets", default="golden/sets", help="folder of golden sets")
    parser.add_argument(
        "--names",
        nargs="*",
        default=["tiny-mistral", "tiny-mixtral"],
        help="sets to measure (default: the zoo's members vLLM serves on CPU)",
    )
    parser.add_argument("--dtype", default="float32", help="dtype to serve in")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (best)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    set_arguments(parser)
    args = parser.parse_args()

    from numalign.replay.engines.vllm import VllmEngine
    from numalign.replay.sets import open_fresh
    from numalign.session.settings import Settings

    engine = VllmEngine(Settings(engine="vllm"))
    print(f"{'set':16} {'start s':>8} {'prefill replay/plain':>22} {'+decode replay/plain':>22}")
    try:
        for name in args.names:
            golden = open_fresh(Path(args.sets) / name)
            started = time.perf_counter()
            engine._engine(golden, args.dtype)
            start = time.perf_counter() - started
            ratios = []
            for decode in (False, True):
                ours = best_of(lambda d=decode, g=golden: replay(engine, g, d), args.repeat)
                theirs = best_of(lambda d=decode, g=golden: plain(engine, g, d), args.repeat)
                ratios.append(f"{ours:.3f}/{theirs:.3f} = {ours / theirs:.2f}x")
            print(f"{name:16} {start:8.1f} {ratios[0]:>22} {ratios[1]:>22}")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
