"""Streamed capture and replay (``--stream``) at depth: synthetic checkpoints of one Llama
shape at several depths (``golden.synthetic``: random weights of the zoo's magnitudes,
written one layer per shard, never whole in memory), each captured with ``numalign capture
--stream`` and replayed by the model suites with ``--stream`` (layers, model, decode), each
step in a process of its own that reports its own peak resident memory (VmHWM). Printed
per depth: the checkpoint's size against this machine's memory, a plain sequential read of
its shards from disk against the capture's hashing of them beside its own reads, each
step's peak memory and wall time, capture time per layer, the suites' outcome; then the
deepest against the shallowest, side by side.

Expected: peak memory independent of depth (one layer's weights plus the activations, the
interpreter and its libraries), capture and replay time per layer the same at every depth,
and a checkpoint larger than memory (the default deepest) captured and replayed whole.

    python bench/bench_depth.py [--depths 4,16,36] [--hidden 4096] [--intermediate 11008]
        [--heads 32] [--vocab 32000] [--work /tmp/numalign-depth] [--suites layers,model,decode]
        [--keep]

The default shape is Llama 2 7B's (multi-head attention), about 0.81 GB of float32 weights
per layer: 36 layers are about 30 GB on disk. Needs that much free disk under ``--work``
for the deepest checkpoint (each depth's checkpoint is removed after it, unless ``--keep``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3


@dataclass
class Step:
    peak_bytes: int
    seconds: float
    tail: str
    returncode: int


#: Runs ``MODULE.main(argv)`` (numalign's command line, pytest) and prints its own peak
#: resident memory (VmHWM, KiB) as it exits: not the kernel's ru_maxrss of the child, which
#: counts the resident memory of the parent it was forked from.
PEAK_OF_MAIN = """
import importlib, sys
main = importlib.import_module(sys.argv[1]).main
try:
    code = main(sys.argv[2:])
finally:
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    print(f"peak-kib {peak}", flush=True)
sys.exit(code)
"""


def run(module: str, args: list[str], log: Path) -> Step:
    """``module``'s main on ``args`` in a process of its own (one thread), its output to
    ``log``: its peak resident memory and wall time."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-c", PEAK_OF_MAIN, module, *args], stdout=out,
                              stderr=subprocess.STDOUT, env=env, check=False)  # fmt: skip
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    peaks = re.findall(r"^peak-kib (\d+)$", text, re.MULTILINE)
    lines = [ln for ln in text.strip().splitlines() if not ln.startswith("peak-kib ")]
    return Step(int(peaks[-1]) * 1024 if peaks else 0, seconds, (lines or [""])[-1],
                done.returncode)  # fmt: skip


def drop_caches() -> bool:
    """Empties the kernel's page cache (root only), so that the next read comes from the
    disk; whether it could."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def plain_read(files: list[Path]) -> float:
    """Bytes a second of one sequential read of ``files``, nothing done with them."""
    size, start = 0, time.perf_counter()
    for file in files:
        with file.open("rb", buffering=0) as fh:
            while block := fh.read(8 << 20):
                size += len(block)
    return size / (time.perf_counter() - start)


def memory_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="4,16,36")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--work", default="/tmp/numalign-depth")
    parser.add_argument("--suites", default="layers,model,decode")
    parser.add_argument("--dtype", default="bfloat16", help="the replay's dtype")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and sets")
    args = parser.parse_args()

    from numalign.golden.synthetic import llama_config, write_synthetic

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    depths = [int(d) for d in args.depths.split(",")]
    rows = {}
    print(f"machine memory {memory_total() / GIB:.1f} GiB; Llama shape hidden {args.hidden}, "
          f"intermediate {args.intermediate}, {args.heads} heads, vocab {args.vocab}")  # fmt: skip
    for depth in depths:
        name = f"synthetic-llama-{args.hidden}x{depth}"
        model_dir, sets = work / "models" / name, work / "sets" / name  # one set a folder
        start = time.perf_counter()
        config = llama_config(depth, hidden=args.hidden, intermediate=args.intermediate,
                              heads=args.heads, vocab=args.vocab)  # fmt: skip
        write_synthetic(config, model_dir)
        written = time.perf_counter() - start
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        print(f"\n{name}: {size / 1e9:.1f} GB written in {written:.0f}s", flush=True)
        cold = drop_caches()
        rate = plain_read(sorted(model_dir.glob("*.safetensors")))
        print(
            f"  a plain sequential read of its shards: {rate / 1e9:.2f} GB/s "
            f"({'from disk' if cold else 'page cache not emptied: not root'})",
            flush=True,
        )
        drop_caches()
        capture = run(
            "numalign.cli",
            ["capture", str(model_dir),
             "--out", str(sets / name), "--force", "--stream", "--calibrate", args.dtype,
             "--calibrate-with", "none", "--continuation", "2", "--decode-steps", "2",
             "--long", "0", "--far", "0", "--no-probes"],
            work / f"{name}.capture.log",
        )  # fmt: skip
        print(f"  capture: {capture.peak_bytes / GIB:.2f} GiB peak, {capture.seconds:.0f}s "
              f"({capture.seconds / depth:.1f}s a layer): {capture.tail}", flush=True)  # fmt: skip
        log = (work / f"{name}.capture.log").read_text(errors="replace")
        hashed = re.search(r"numalign capture: (.* hashed in .*)", log)
        print(f"  {hashed.group(1) if hashed else 'no hashing line'}", flush=True)
        if capture.returncode:
            sys.exit(f"capture failed: see {work / f'{name}.capture.log'}")
        replays = {}
        for suite in args.suites.split(","):
            suite_file = ROOT / "suites" / "models" / f"test_{suite}.py"
            step = run(
                "pytest",
                [str(suite_file), "-q", "-p", "no:cacheprovider",
                 "-p", "no:xdist", "--golden", str(sets), "--golden-only", "--stream",
                 "--dtype", args.dtype, "--report-dir", str(work / "reports")],
                work / f"{name}.{suite}.log",
            )  # fmt: skip
            replays[suite] = step
            print(f"  replay {suite}: {step.peak_bytes / GIB:.2f} GiB peak, {step.seconds:.0f}s: "
                  f"{step.tail}", flush=True)  # fmt: skip
        rows[depth] = (size, capture, replays)
        if not args.keep:
            shutil.rmtree(model_dir)
            shutil.rmtree(sets, ignore_errors=True)

    shallow, deep = min(rows), max(rows)
    if shallow == deep:
        return
    (s_size, s_cap, s_rep), (d_size, d_cap, d_rep) = rows[shallow], rows[deep]
    print(f"\n{deep} layers against {shallow} ({d_size / s_size:.2f}x the weights):")
    print(
        f"  capture peak memory {d_cap.peak_bytes / s_cap.peak_bytes:.2f}x, "
        f"time per layer {(d_cap.seconds / deep) / (s_cap.seconds / shallow):.2f}x"
    )
    for suite in d_rep:
        peak = d_rep[suite].peak_bytes / s_rep[suite].peak_bytes
        per_layer = (d_rep[suite].seconds / deep) / (s_rep[suite].seconds / shallow)
        print(f"  replay {suite} peak memory {peak:.2f}x, time per layer {per_layer:.2f}x")
    passed = all(re.search(r"\bfailed\b|\berror", s.tail) is None for s in d_rep.values())
    print(f"  the deepest replays {'passed' if passed else 'did NOT pass'}")


if __name__ == "__main__":
    main()
