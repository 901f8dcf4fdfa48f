"""The cost of the serving matrix (issue 41, item 7): per golden set, each serving
arrangement's replay serving (``--serving``: every row, hooks on every mapped point, decode
rows forced, in that arrangement) against a plain ``LLM.generate`` of the same golden rows
on the default engine (nothing observed, greedy), measured side by side in one process, and
the whole matrix against the plain serving. Each arrangement's engine starts once (its
start-up is reported, not in the ratios): an arrangement serves more tokens than plain where
it is built to (crowded: 64 rows; prefix-cached: every row twice), and its ratio says so.

Run in the environment that has vLLM (see docs/vllm.md):

    python bench/bench_serving.py [--sets golden/sets] [--names tiny-mistral] [--dtype float32]
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

from bench_vllm import plain, set_arguments
from timing import best_of


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    set_arguments(parser)
    args = parser.parse_args()

    from numalign.replay.engines.errors import EngineUnsupported
    from numalign.replay.engines.vllm import VllmEngine
    from numalign.replay.engines.vllm_serving import serve_rows
    from numalign.replay.sets import open_fresh
    from numalign.runtime.serving import ARRANGEMENTS, DEFAULT_SERVING
    from numalign.session.settings import Settings

    engine = VllmEngine(Settings(engine="vllm"))
    print(f"{'set':14} {'arrangement':15} {'start s':>8} {'replay/plain s':>24} {'exercised'}")
    try:
        for name in args.names:
            golden = open_fresh(Path(args.sets) / name)
            engine._engine(golden, args.dtype, ARRANGEMENTS[DEFAULT_SERVING])
            baseline = best_of(lambda g=golden: plain(engine, g, True), args.repeat)
            total = 0.0
            for arrangement in ARRANGEMENTS.values():
                started = time.perf_counter()
                running = engine._engine(golden, args.dtype, arrangement)
                start = time.perf_counter() - started
                served: list[Any] = []

                def serve(a: Any = arrangement, r: Any = running, g: Any = golden,
                          out: list[Any] = served) -> None:  # fmt: skip
                    out[:] = [serve_rows(r, g, a)]

                took = best_of(serve, args.repeat)
                total += took
                exercised = served[0].exercised
                missing = exercised.unexercised(arrangement, golden.name, [])
                seen = "NOT EXERCISED" if missing else (
                    f"{exercised.steps} steps, {exercised.most_rows} rows, "
                    f"{exercised.chunked_prompts} chunked, {exercised.prefix_hit_tokens} hit, "
                    f"{exercised.preemptions} preempted"
                )  # fmt: skip
                ratio = f"{took:.3f}/{baseline:.3f} = {took / baseline:.2f}x"
                print(f"{name:14} {arrangement.name:15} {start:8.1f} {ratio:>24} {seen}")
            whole = f"{total:.3f}/{baseline:.3f} = {total / baseline:.2f}x"
            print(f"{name:14} {'(the matrix)':15} {'':8} {whole:>24}")
    except EngineUnsupported as exc:
        print(f"skipped: {exc}")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
