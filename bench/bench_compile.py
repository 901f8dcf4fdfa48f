"""The cost of compiled replay (``--compile``), measured side by side in one process: for
each zoo model, full-model replay (every point, logits, continuation) eager and compiled in
one dtype, and operator candidates eager and compiled over the smoke cases of their
operators (a plain ``torch`` candidate and tiled ones: their graphs are the catalogue's
largest). Prints, per model and in all:

- compiled replay against eager replay, both warm (the compiled artifact reused: what every
  later test of a worker pays);
- compile time against compiled run time (what the first test of a worker pays on top);
- the cold compiled test (compile plus run) against the eager one.

Single-threaded (as each xdist worker of the suites). Inductor's on-disk caches make a
second invocation compile faster: pass ``--cold`` to point them at a fresh folder first.

    python bench/bench_compile.py [--models tiny-llama tiny-gpt2] [--dtype bfloat16]
        [--operators rms_norm:torch attention:tiled] [--backend inductor] [--repeat 3] [--cold]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from timing import best_of

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def bench_model(name: str, dtype: str, backend: str, repeat: int) -> dict[str, float]:
    """Eager and compiled full-model replay of one zoo set: seconds of each phase."""
    import torch

    from numalign.replay.model import ModelCache, replay_model
    from numalign.replay.sets import open_fresh
    from numalign.runtime.compiled import CompileSpec
    from numalign.runtime.compiled_model import take_stats
    from numalign.runtime.variant import Variant

    device = torch.device("cpu")
    golden = open_fresh(Path("golden/sets") / name)
    cache = ModelCache()
    variant = Variant(engine="transformers", device=str(device), dtype=dtype)
    eager = cache.get(golden, variant)
    compiled = cache.get(golden, variant.with_changes(compile=CompileSpec(backend)))
    replay_model(golden, eager, dtype, device)  # warm: the golden tensors read once
    eager_s = best_of(lambda: replay_model(golden, eager, dtype, device), repeat)
    start = time.perf_counter()
    verdict = replay_model(golden, compiled, dtype, device)
    cold_s = time.perf_counter() - start
    stats = take_stats(compiled)
    compile_s = stats.compile_s if stats else 0.0
    run_s = best_of(lambda: replay_model(golden, compiled, dtype, device), repeat)
    return {"eager": eager_s, "compiled": run_s, "compile": compile_s, "cold": cold_s,
            "passed": float(verdict.passed)}  # fmt: skip


def bench_operator(op_name: str, candidate: str, backend: str, repeat: int) -> dict[str, float]:
    """One candidate over its operator's smoke cases in bfloat16, eager and compiled."""
    import torch

    from numalign.ops.check import candidate_function, check_operator
    from numalign.ops.registry import OPERATORS, candidates, load_catalogue
    from numalign.runtime.compiled import CompileSpec

    load_catalogue()
    op, cand = OPERATORS[op_name], candidates(op_name)[candidate]
    spec, device, dtype = CompileSpec(backend), torch.device("cpu"), torch.bfloat16
    cases = op.cases_for("smoke")

    def run(compiled: CompileSpec | None) -> None:
        for case in cases:
            check_operator(op, cand, case, dtype, device, compiled=compiled)

    run(None)  # truths and controls cached, as in the suite
    eager_s = best_of(lambda: run(None), repeat)
    start = time.perf_counter()
    run(spec)
    cold_s = time.perf_counter() - start
    stats = candidate_function(op, cand, spec).stats.take()  # type: ignore[attr-defined]
    run_s = best_of(lambda: run(spec), repeat)
    return {"eager": eager_s, "compiled": run_s, "compile": stats.compile_s, "cold": cold_s,
            "passed": 1.0}  # fmt: skip


def _line(label: str, t: dict[str, float]) -> str:
    return (
        f"{label:<28} eager {t['eager']:7.3f} s  compiled {t['compiled']:7.3f} s "
        f"({t['compiled'] / t['eager']:5.2f}x)  compile {t['compile']:7.1f} s "
        f"({t['compile'] / t['compiled']:7.0f}x the compiled run)  cold test "
        f"{t['cold'] / t['eager']:6.0f}x eager" + ("" if t["passed"] else "  [FAILED]")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "tiny-gpt2"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--operators",
        nargs="*",
        default=["rms_norm:torch", "attention:tiled", "matmul:tiled"],
        help="OPERATOR:CANDIDATE ...",
    )
    parser.add_argument("--cold", action="store_true", help="empty Inductor caches first")
    args = parser.parse_args()
    if args.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="numalign-inductor-")

    import torch

    torch.set_num_threads(1)
    rows: dict[str, dict[str, float]] = {}
    for name in args.models:
        rows[f"{name} [{args.dtype}]"] = bench_model(name, args.dtype, args.backend, args.repeat)
        print(_line(f"{name} [{args.dtype}]", rows[f"{name} [{args.dtype}]"]), flush=True)
    for spec in args.operators:
        op, _, cand = spec.partition(":")
        rows[f"{op}/{cand} smoke"] = bench_operator(op, cand, args.backend, args.repeat)
        print(_line(f"{op}/{cand} smoke [bfloat16]", rows[f"{op}/{cand} smoke"]), flush=True)
    total = {k: sum(r[k] for r in rows.values()) for k in ("eager", "compiled", "compile", "cold")}
    print(f"backend {args.backend}, all of the above:")
    print(f"  compiled replay / eager replay (warm): {total['compiled'] / total['eager']:.2f}x")
    print(f"  compile time / compiled run time:      {total['compile'] / total['compiled']:.0f}x")
    print(f"  first compiled test / eager test:      {total['cold'] / total['eager']:.0f}x")


if __name__ == "__main__":
    main()
