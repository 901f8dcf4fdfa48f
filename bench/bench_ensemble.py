"""The capture cost of ensemble calibration against today's single control, side by side in
one run: the same model captured (a) with the reference alone calibrating bfloat16 and
float16 (numalign before the ensemble) and (b) with the default ensemble calibrating float32,
bfloat16 and float16. Prints both times and their ratio (target: at most 3x).

    python bench/bench_ensemble.py [MODEL_DIR] [--repeats N]

Default model: the zoo's tiny-deep-llama (24 layers). A real checkpoint (SmolLM2-135M, made
by hand from a package's GGUF) is the figure that matters: there the forwards dominate.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from timing import best_of

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("model", nargs="?", default=str(ROOT / "golden/models/tiny-deep-llama"))
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    from numalign.golden.capture_spec import CaptureSpec
    from numalign.replay.ensemble import Member, capture_calibrated

    quiet = CaptureSpec(progress=False)
    with tempfile.TemporaryDirectory() as scratch:

        def single() -> None:
            capture_calibrated(args.model, Path(scratch) / "single", quiet,
                               calibrate=("bfloat16", "float16"),
                               members=[Member("reference")])  # fmt: skip

        def ensemble() -> None:
            capture_calibrated(args.model, Path(scratch) / "ensemble", quiet)

        t_single = best_of(single, args.repeats)
        t_ensemble = best_of(ensemble, args.repeats)
    print(f"model {args.model}")
    print(f"  reference alone, bfloat16 + float16:   {t_single:7.1f} s")
    print(f"  ensemble, float32 + bfloat16 + float16: {t_ensemble:7.1f} s")
    print(f"  ratio {t_ensemble / t_single:.2f}x (target <= 3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
