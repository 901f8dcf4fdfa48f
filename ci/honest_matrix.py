"""The honest-variation matrix: numalign's suites replayed under every honest kernel variant
this CPU offers, each of which must give zero failures: honest variation is tested, not
assumed (docs/ci.md, "The honest-variation matrix").

Each variant changes what another machine would change, in combinations that are not members
of the zoo's calibration ensemble (``numalign.replay.ensemble.default_members``: "low" is
oneDNN AVX2 + ATen default + 1 thread + the other attention; "mid" is oneDNN one level below
the machine's + ATen AVX2 + every core), so that passing is not passing by construction:

- ``isa-avx2``: oneDNN at AVX2 with ATen at AVX2 (a machine without AVX-512);
- ``isa-avx512-scalar``: oneDNN at AVX512_CORE with ATen's scalar kernels, two workers (one
  thread each);
- ``threads-2-sdpa``: the native kernels, one process with two threads, SDPA attention;
- ``swap-fused-rms-norm``, ``swap-var-mean-layer-norm``: the native kernels with an honest
  fused RMSNorm, or a var_mean LayerNorm, swapped into every model that has one (float32
  accumulation in another order than the reference's).

The instruction-set variants run every dtype; the three that reorder a reduction run float32
and bfloat16.

Variants whose instruction set this CPU lacks are skipped (said in the table). The model
suites run for every variant, on the zoo and on a sample of the day-0 sweep's types
(``SWEEP_SAMPLE``, ``--sweep-sample``: built and captured first, as ``numalign zoo sweep``
builds them); the operator suite (``--operators``, tier pr) for the two instruction-set
variants. The matrix prints a table (variant, suite, exit code, the worst use of budget
among passed records, its wall time, pytest's closing line) and exits 1 on any failure,
error or crash (an expected failure, the paged engine's soft-capping gap where its signature
matches, is pytest's xfail and not a failure). ``--only NAME`` runs some variants;
``--report-dir`` keeps each variant's run under ``<dir>/<variant>/``.

    python ci/honest_matrix.py [--operators] [--only isa-avx2 ...] [--sweep-sample a,b]
                               [-- extra pytest args]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Variant:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    #: pytest arguments (numalign options) besides the suite
    args: tuple[str, ...] = ()
    #: xdist workers (0: one process)
    workers: int = 2
    #: CPU flags the variant needs
    needs: tuple[str, ...] = ()
    operators: bool = False


#: The dtypes of the variants that reorder a reduction (below).
TWO_DTYPES = ("--dtype", "float32,bfloat16")

VARIANTS = (
    Variant(
        "isa-avx2",
        {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
        needs=("avx2",),
        operators=True,
    ),
    Variant(
        "isa-avx512-scalar",
        {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "default"},
        needs=("avx512f",),
        operators=True,
    ),
    # the variants below change a reduction's order, not the instruction set: float32 and
    # bfloat16 (the widest and the narrowest mantissa) judge them; float16 runs in the two
    # instruction-set variants above
    Variant("threads-2-sdpa", args=("--attn-implementation", "sdpa", *TWO_DTYPES), workers=0),
    # each swap on the models that have its module (one without it would skip with the
    # reason, at a quarter second a test: 900 of them for the LayerNorm swap): BERT, GPT-2
    # and BLOOM have no RMSNorm; of the others only Qwen2-VL's vision tower has LayerNorms
    Variant(
        "swap-fused-rms-norm",
        args=(
            "--swap",
            "rms_norm=fused",
            *TWO_DTYPES,
            "-k",
            "not tiny-bert and not tiny-gpt2 and not bloom",
        ),
    ),
    Variant(
        "swap-var-mean-layer-norm",
        args=(
            "--swap",
            "layer_norm=var_mean",
            *TWO_DTYPES,
            "-k",
            "tiny-bert or tiny-gpt2 or tiny-qwen2-vl or bloom",
        ),
    ),
)

#: Types of the day-0 sweep replayed besides the zoo, architectures the zoo has none of:
#: gpt-oss (attention sinks, MoE with biases), Jamba (Mamba mixers beside attention, MoE),
#: BLOOM (ALiBi, LayerNorm, fused query-key-value). Each costs about 20 s to build and
#: capture here and a few seconds per variant.
SWEEP_SAMPLE = ("gpt_oss", "jamba", "bloom")


def sweep_sample(types: list[str], out: Path) -> Path:
    """Builds and captures (calibrated, as the sweep does) each of ``types`` under ``out``;
    returns the folder of their sets."""
    sys.path.insert(0, str(ROOT / "src"))
    from numalign.golden.capture_spec import CaptureSpec
    from numalign.replay.ensemble import capture_calibrated
    from numalign.sweep.build import build_tiny

    sets = out / "sets"
    for model_type in types:
        print(f"== sweep sample: building and capturing {model_type}", flush=True)
        model_dir = build_tiny(model_type, out / "models")
        capture_calibrated(model_dir, sets / model_type, CaptureSpec(progress=False, force=True))
    return sets


def cpu_flags() -> frozenset[str]:
    sys.path.insert(0, str(ROOT / "src"))
    from numalign.replay.ensemble import cpu_flags as flags

    return flags()


def worst_passed(run: Path) -> float:
    """The worst use of budget among the passed records of one run."""
    worst = 0.0
    with (run / "records.jsonl").open(encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            used = record.get("budget_used")
            if record.get("verdict") == "passed" and isinstance(used, int | float):
                worst = max(worst, float(used))
    return worst


def run_variant(
    variant: Variant, suite: str, report_dir: Path, extra: list[str]
) -> tuple[int, str]:
    """Runs one suite under the variant: its exit code and pytest's closing line."""
    out = report_dir / variant.name / suite.replace("/", "-")
    command = [sys.executable, "-m", "pytest", suite, "-q", "-p", "no:cacheprovider",
               "--report-dir", str(out), *variant.args, *extra]  # fmt: skip
    command += ["-n", str(variant.workers)] if variant.workers else ["-p", "no:xdist"]
    env = os.environ | variant.env | {"HF_HUB_OFFLINE": "1"}
    print(f"== {variant.name}: {' '.join(f'{k}={v}' for k, v in variant.env.items())} "
          f"pytest {' '.join(command[3:])}", flush=True)  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    print("\n".join(lines[-15:]), flush=True)
    return done.returncode, (lines[-1] if lines else "no output").strip("= ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--only", nargs="+", choices=[v.name for v in VARIANTS])
    parser.add_argument("--operators", action="store_true", help="also the operator suite")
    parser.add_argument("--report-dir", type=Path, default=ROOT / "reports" / "honest-matrix")
    parser.add_argument(
        "--sweep-sample",
        default=",".join(SWEEP_SAMPLE),
        help="comma list of sweep types replayed besides the zoo ('' for none)",
    )
    parser.add_argument("extra", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    flags = cpu_flags()
    sample = [t for t in args.sweep_sample.split(",") if t]
    started = time.monotonic()
    sample_args = (
        ["--golden", str(sweep_sample(sample, args.report_dir / "sweep-sample"))] if sample else []
    )
    if sample:
        print(f"== sweep sample built and captured in {time.monotonic() - started:.0f} s")
    failed, rows = False, []
    for variant in VARIANTS:
        if args.only and variant.name not in args.only:
            continue
        missing = [f for f in variant.needs if f not in flags]
        if missing:
            rows.append((variant.name, "models", f"skipped: this CPU lacks {', '.join(missing)}"))
            continue
        suites = ["suites/models"] + (["suites/operators"] if args.operators and variant.operators
                                      else [])  # fmt: skip
        for suite in suites:
            extra = [*args.extra, *(sample_args if suite == "suites/models" else [])]
            started = time.monotonic()
            code, closing = run_variant(variant, suite, args.report_dir, extra)
            took = time.monotonic() - started
            run = args.report_dir / variant.name / suite.replace("/", "-") / "latest"
            worst = worst_passed(run) if (run / "records.jsonl").is_file() else float("nan")
            rows.append((variant.name, suite,
                         f"exit {code}; worst {worst:.3g}; {took:.0f} s; {closing}"))  # fmt: skip
            failed |= code != 0
    print("\nhonest-variation matrix:")
    for name, suite, text in rows:
        print(f"  {name:20} {suite:18} {text}")
    print("honest matrix: " + ("FAILED (a false alarm above)" if failed else "no false alarm"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
