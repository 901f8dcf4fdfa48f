"""The numalign command line. Every command calls the public library API only."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from numalign.golden.decode import DEFAULT_DECODE_STEPS
from numalign.golden.store import DEFAULT_SETS, discover_sets
from numalign.settings import ATTN_IMPLEMENTATIONS, DEFAULT_TIER, TIERS


def _report(args: argparse.Namespace) -> int:
    """numalign report RUN | numalign report merge RUN... --out DIR"""
    from numalign.report import merge_runs, render_run

    paths = [Path(p) for p in args.paths]
    if args.paths[0] == "merge":
        if len(paths) < 2 or args.out is None:
            print(
                "numalign report merge: give the run folders to merge and --out DIR",
                file=sys.stderr,
            )
            return 2
        run_dir = merge_runs(_existing(paths[1:]), Path(args.out))
    elif len(paths) == 1:
        run_dir = _existing(paths)[0]
    else:
        print(
            "numalign report: one run folder (or: numalign report merge RUN... --out DIR)",
            file=sys.stderr,
        )
        return 2
    baseline = Path(args.baseline) if args.baseline else None
    if baseline is not None and not baseline.exists():
        print(
            f"numalign report: --baseline {baseline}: no such run folder or records file",
            file=sys.stderr,
        )
        return 2
    rendered = render_run(
        run_dir,
        baseline=baseline,
        factor=args.factor,
        history=Path(args.history) if args.history else None,
        append=False,
    )
    for path in rendered.written:
        print(path)
    if rendered.diff is not None:
        print(f"{len(rendered.diff.regressed)} regression(s) against {baseline}")
        if rendered.diff.regressed and args.fail_on_regression:
            return 1
    return 0


def _capture(args: argparse.Namespace) -> int:
    from numalign.golden.reference import Placement, parse_max_memory
    from numalign.replay.ensemble import capture_calibrated

    placement = None
    if args.device_map:
        try:
            memory = parse_max_memory(args.max_memory or "")
        except ValueError as exc:
            raise SystemExit(f"numalign capture: {exc}") from None
        folder = Path(args.offload_folder) if args.offload_folder else None
        placement = Placement(args.device_map, folder, memory or None)
    elif args.offload_folder or args.max_memory:
        raise SystemExit(
            "numalign capture: --offload-folder and --max-memory place a model with "
            "--device-map (e.g. --device-map auto --offload-folder DIR)"
        )
    from numalign.replay.ensemble import Member

    members = None
    if args.calibrate_with:
        try:
            named = [Member.parse(spec) for spec in args.calibrate_with if spec != "none"]
        except ValueError as exc:
            raise SystemExit(f"numalign capture: {exc}") from None
        members = [Member("reference"), *named]
    prompts = None
    if args.prompts:
        prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    golden = capture_calibrated(
        args.model_dir,
        args.out,
        points=args.points,
        prompts=prompts,
        image=args.image,
        reference_dtype=args.reference_dtype,
        calibrate=[d for d in args.calibrate.split(",") if d],
        members=members,
        continuation=args.continuation,
        decode_steps=args.decode_steps,
        long=args.long,
        attn_implementation=args.attn_implementation,
        trust_remote_code=args.trust_remote_code,
        placement=placement,
        force=args.force,
    )
    print(f"{golden.path}: {len(golden.points)} points, {golden.disk_bytes() / 1e6:.2f} MB")
    return 0


def _zoo(args: argparse.Namespace) -> int:
    from numalign.golden.zoo import build_zoo
    from numalign.replay.ensemble import capture_calibrated

    for path in build_zoo(args.out, args.names or None):
        line = f"{path}"
        if args.sets:
            golden = capture_calibrated(path, Path(args.sets) / path.name, progress=False)
            line += f" -> {golden.path} ({len(golden.points)} points)"
        print(line)
    return 0


def _golden(args: argparse.Namespace) -> int:
    from numalign.golden import GoldenSet

    if args.action == "ls":
        return _golden_ls(Path(args.target or DEFAULT_SETS))
    if not args.target:
        print(f"numalign golden {args.action}: give a golden set folder", file=sys.stderr)
        return 2
    g = GoldenSet.open(args.target)
    if args.action == "verify":
        g.verify(contents=True)
        g.check_fresh()
        print(
            f"{g.path}: {len(g.manifest.shards)} shard(s) and {len(g.manifest.tensors)} "
            "tensor(s) verified; model fresh"
        )
        return 0
    m, ref = g.manifest, g.reference
    print(f"set        {g.path}")
    print(f"model      {g.model.name} ({g.model.architecture}) at {g.model_dir}")
    print(f"fingerprint {g.model.fingerprint}")
    print(f"reference  {ref.dtype} on {ref.device}, attention {ref.attn_implementation}, "
          f"torch {ref.torch}, transformers {ref.transformers}")  # fmt: skip
    print(f"requests   {', '.join(r.name for r in g.requests)}")
    print(f"calibrated {', '.join(m.calibration) or 'no'}")
    for dtype, members in m.ensemble.items():
        print(f"  {dtype:9} over {len(members)} member(s): {'; '.join(members)}")
    print(
        f"size       {g.disk_bytes() / 1e6:.2f} MB on disk, "
        f"{g.unique_tensor_bytes() / 1e6:.2f} MB of unique tensors"
    )
    for point in g.points:
        calls = [c for request in point.calls.values() for c in request]
        outputs = ", ".join(
            f"{path}: {_described(m.tensors.get(key))}"
            for path, key in (calls[0].outputs.items() if calls else ())
        )
        print(f"  {point.name:52} {point.type:28} {outputs or '(no calls)'}")
    return 0


def _described(info: object) -> str:
    """A tensor's dtype and shape from the manifest, or what is wrong (show never raises)."""
    if info is None:
        return "MISSING from the manifest (numalign golden verify)"
    return f"{getattr(info, 'dtype', '?')}{getattr(info, 'shape', '?')}"


def _golden_ls(folder: Path) -> int:
    """One line per set under ``folder``; a set that cannot be read is a line saying why
    (exit 1), never the end of the listing."""
    from numalign.golden import GoldenSet, GoldenSetError

    if not folder.is_dir():
        print(f"numalign golden ls: {folder}: no such folder", file=sys.stderr)
        return 2
    status = 0
    for path in discover_sets([folder]):
        try:
            g = GoldenSet.open(path)
            fresh = "fresh" if g.model_dir.is_dir() and g.fingerprint_matches() else "STALE"
            print(f"{g.name:24} {g.model.architecture:36} {len(g.points):4} points "
                  f"{g.disk_bytes() / 1e6:8.2f} MB  {fresh}")  # fmt: skip
        except (GoldenSetError, OSError, ValueError) as exc:
            print(f"{path.name:24} BROKEN: {exc}")
            status = 1
    return status


def _inventory(args: argparse.Namespace) -> int:
    from numalign.inventory import inventory

    result = inventory(args.model_dir, trust_remote_code=args.trust_remote_code)
    print(result.to_json() if args.format == "json" else result.to_markdown(), end="")
    return 0


def _nightly(args: argparse.Namespace) -> int:
    from numalign.nightly import nightly

    return nightly(
        Path(args.models), Path(args.sets), [Path(s) for s in args.suites], Path(args.report_dir),
        tier=args.tier, device=args.device, dtypes=args.dtype, extra=args.pytest_args or [],
        compile_backend=args.compile,
    )  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    from numalign.nightly import bring_up

    return bring_up(
        Path(args.model_dir), Path(args.sets), Path(args.suites), Path(args.report_dir),
        device=args.device, dtypes=args.dtype, tier=args.tier, tp=args.tp,
    )  # fmt: skip


def _existing(paths: list[Path]) -> list[Path]:
    missing = [p for p in paths if not (p / "records.jsonl").is_file()]
    if missing:
        raise SystemExit(
            f"numalign report: no records.jsonl in {', '.join(map(str, missing))}: give run "
            "folders as written under --report-dir (reports/<run-id>/)"
        )
    return paths


def build_parser() -> argparse.ArgumentParser:
    from numalign import __version__

    parser = argparse.ArgumentParser(
        prog="numalign",
        description="Numerical alignment and regression suite for LLMs on AI accelerators. "
        "The suites run under pytest: pytest -n auto suites/",
    )
    parser.add_argument("--version", action="version", version=f"numalign {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    report = commands.add_parser(
        "report",
        help="render a run's drift report (or merge runs: report merge RUN... --out DIR)",
        description="Re-renders drift.html, drift.csv and summary.json of a run folder, "
        "optionally against a baseline run; 'report merge RUN... --out DIR' first joins "
        "the records of several runs (shards, machines) into DIR.",
    )
    report.add_argument("paths", nargs="+", metavar="RUN", help="a run folder, or: merge RUN...")
    report.add_argument("--baseline", help="a run folder or records.jsonl to compare against")
    report.add_argument("--factor", type=float, default=2.0, help="regression factor (default 2)")
    report.add_argument("--history", help="history file whose trend the report draws")
    report.add_argument("--out", help="output run folder of 'report merge'")
    report.add_argument("--fail-on-regression", action="store_true", help="exit 1 on regressions")
    report.set_defaults(handler=_report)

    cap = commands.add_parser(
        "capture",
        help="capture a golden set from a local Hugging Face model folder",
        description="Runs the model (loaded offline with from_pretrained) on built-in or given "
        "prompts (and long requests past every length boundary of the model), records every "
        "capture point's inputs and outputs, the logits, a greedy continuation and a cached "
        "decode, calibrates lower dtypes, and writes the set atomically.",
    )
    cap.add_argument("model_dir", metavar="MODEL_DIR")
    cap.add_argument(
        "--out",
        required=True,
        help="the golden set folder, e.g. golden/sets/NAME: a new folder, or a set of this model",
    )
    cap.add_argument(
        "--force",
        action="store_true",
        help="replace a set of another model at --out (kept under its folder's .versions/)",
    )
    cap.add_argument(
        "--points", nargs="+", metavar="PATTERN", help="module name patterns (fnmatch)"
    )
    cap.add_argument("--prompts", metavar="FILE", help="one prompt per line")
    cap.add_argument("--image", metavar="FILE", help="image for image-text models")
    cap.add_argument("--reference-dtype", default="float32", choices=["float32", "float64"])
    cap.add_argument(
        "--calibrate",
        default="float32,bfloat16,float16",
        help="dtypes to calibrate ('' for none; default: float32,bfloat16,float16)",
    )
    cap.add_argument(
        "--calibrate-with",
        action="append",
        metavar="MEMBER",
        help="a member of the calibration ensemble besides the reference, as key=value,... "
        "(onednn=AVX2, aten=default, threads=1, attn=sdpa, dtypes=float32/bfloat16, or an "
        "ENV_VAR=value); repeatable; "
        "replaces the default members (on the CPU: oneDNN and ATen instruction sets below the "
        "machine's, one thread and several, the other attention); 'none': the reference alone",
    )
    cap.add_argument("--continuation", type=int, default=8, help="greedy tokens to record")
    cap.add_argument(
        "--decode-steps",
        type=int,
        default=DEFAULT_DECODE_STEPS,
        help=f"cached decode steps to record per generating request (default "
        f"{DEFAULT_DECODE_STEPS}; 0: none)",
    )
    cap.add_argument(
        "--long",
        type=int,
        default=None,
        metavar="TOKENS",
        help="length of the long requests (default: past the sliding window, the linear-"
        "attention chunk and the paged replay's page size, from the config; 0: none)",
    )
    cap.add_argument("--attn-implementation", choices=ATTN_IMPLEMENTATIONS)
    cap.add_argument("--trust-remote-code", action="store_true")
    cap.add_argument(
        "--device-map",
        metavar="MAP",
        help="load the model with accelerate's big-model placement (auto, balanced, "
        "sequential): for weights that do not fit in memory; the set is the same",
    )
    cap.add_argument(
        "--offload-folder",
        metavar="DIR",
        help="with --device-map: where weights that fit nowhere are offloaded (disk)",
    )
    cap.add_argument(
        "--max-memory",
        metavar="DEVICE=SIZE,...",
        help="with --device-map: memory each device may hold, e.g. cpu=2GiB or 0=20GiB,cpu=64GiB",
    )
    cap.set_defaults(handler=_capture)

    inv = commands.add_parser(
        "inventory",
        help="the catalogue operators a model needs, and which are covered (no weights read)",
        description="Builds the model on the meta device from its config, lists its module "
        "types and the aten operators a forward runs, and maps them to catalogue operators: "
        "where each is used, and whether candidates cover it, only the reference, or nothing.",
    )
    inv.add_argument("model_dir", metavar="MODEL_DIR")
    inv.add_argument("--format", choices=["md", "json"], default="md")
    inv.add_argument("--trust-remote-code", action="store_true")
    inv.set_defaults(handler=_inventory)

    night = commands.add_parser(
        "nightly",
        help="recapture sets of changed models, run the suites against the last nightly",
        description="Recaptures the golden set of every model folder whose fingerprint no "
        "longer matches (the previous version is kept under SETS/.versions/), runs the suites "
        "against the previous nightly run as the baseline, and exits non-zero on a failure "
        "or a regression. Models that did not change are not recaptured.",
    )
    night.add_argument("--models", default="golden/models")
    night.add_argument("--sets", default=str(DEFAULT_SETS))
    night.add_argument("--suites", nargs="+", default=["suites"])
    night.add_argument("--report-dir", default="reports/nightly")
    night.add_argument("--tier", default=TIERS[-1], choices=TIERS)
    night.add_argument("--device")
    night.add_argument("--dtype")
    night.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="then run layer and model replay through torch.compile (default backend inductor) "
        "into REPORT_DIR/compiled, against tonight's eager run (ci/nightly.sh does)",
    )
    night.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    night.set_defaults(handler=_nightly)

    run = commands.add_parser(
        "run",
        help="bring up a model: inventory, capture if needed, the suites, the reports",
    )
    run.add_argument("model_dir", metavar="MODEL_DIR")
    run.add_argument("--sets", default=str(DEFAULT_SETS))
    run.add_argument("--suites", default="suites")
    run.add_argument("--report-dir", default="reports")
    run.add_argument("--tier", default=DEFAULT_TIER, choices=TIERS)
    run.add_argument("--device")
    run.add_argument("--dtype")
    run.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="replay the model tensor-parallel on N ranks of torch.distributed (default 1)",
    )
    run.set_defaults(handler=_run)

    zoo = commands.add_parser("zoo", help="the embedded tiny model zoo")
    zoo.add_argument("action", choices=["build"])
    zoo.add_argument("names", nargs="*", help="zoo models to build (default: all)")
    zoo.add_argument("--out", default="golden/models")
    zoo.add_argument(
        "--sets", default=str(DEFAULT_SETS), help="capture their golden sets here ('' not to)"
    )
    zoo.set_defaults(handler=_zoo)

    golden = commands.add_parser("golden", help="list, show and verify golden sets")
    golden.add_argument("action", choices=["ls", "show", "verify"])
    golden.add_argument("target", nargs="?", help="a set folder (ls: a folder of sets)")
    golden.set_defaults(handler=_golden)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.handler(args))
    except (OSError, ValueError, RuntimeError) as exc:  # GoldenSetError is a RuntimeError
        print(f"numalign {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
