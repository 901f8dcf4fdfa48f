"""numalign inventory, plan, run and nightly: a model's bring-up, from what it needs to
the suites on it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from numalign.cli.common import check_dtypes, check_model, check_run_options, subparser
from numalign.core.statistics import DEFAULT_WIDTH
from numalign.golden.decode import DEFAULT_DECODE_STEPS
from numalign.golden.requests import FAR_LENGTH
from numalign.golden.store import DEFAULT_SETS
from numalign.session import options
from numalign.session.option_values import ENGINES, TIERS

#: Where ``numalign run`` keeps the sets it captures: outside the tracked golden/sets (which
#: every ``pytest suites/`` replays), git-ignored.
RUN_SETS = Path(".numalign") / "sets"


def _inventory(args: argparse.Namespace) -> int:
    from numalign.ops.inventory import inventory

    check_model(args.model_dir, "inventory")

    result = inventory(args.model_dir, trust_remote_code=args.trust_remote_code)
    print(result.to_json() if args.format == "json" else result.to_markdown(), end="")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """numalign plan MODEL_DIR: what a capture and a replay will take (numalign.plan)."""
    from numalign.plan import plan
    from numalign.session.option_values import parse_size

    check_model(args.model_dir, "plan")
    check_dtypes(args.dtype, "--dtype", "plan")
    try:
        device_memory = parse_size(args.device_memory, "--device-memory")
    except ValueError as exc:
        raise SystemExit(f"numalign plan: {exc}") from None
    result = plan(
        args.model_dir, dtypes=tuple(d for d in args.dtype.split(",") if d),
        reference_dtype=args.reference_dtype, device_memory=device_memory, long=args.long,
        far=args.far, max_position=args.max_position, continuation=args.continuation,
        decode_steps=args.decode_steps, trust_remote_code=args.trust_remote_code,
        measured=not args.no_measure, full_points=args.full_points,
        sketch_width=args.sketch_width,
    )  # fmt: skip
    print(result.to_json() if args.json else result.to_text(), end="")
    return 0


def _nightly(args: argparse.Namespace) -> int:
    from numalign.cli.nightly_flow import nightly

    check_run_options(args, "nightly")
    if not Path(args.models).is_dir():
        raise SystemExit(
            f"numalign nightly: --models {args.models}: no such folder of model folders "
            "(numalign zoo build writes the zoo's into golden/models)"
        )

    return nightly(
        Path(args.models), Path(args.sets), [Path(s) for s in args.suites], Path(args.report_dir),
        tier=args.tier, device=args.device, dtypes=args.dtype, extra=args.pytest_args or [],
        compile_backend=args.compile,
    )  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    from numalign.cli.nightly_flow import bring_up

    check_model(args.model_dir, "run")
    check_run_options(args, "run")
    if not (Path(args.suites) / "models").is_dir():
        raise SystemExit(
            f"numalign run: --suites {args.suites}: no models/ suite in it; run from the "
            "repository root, or give the suites folder of a numalign checkout"
        )

    return bring_up(
        Path(args.model_dir), Path(args.sets), Path(args.suites), Path(args.report_dir),
        device=args.device, dtypes=args.dtype, tier=args.tier, tp=args.tp, pp=args.pp,
        engine=args.engine, stream=bool(args.stream), serving=args.serving,
    )  # fmt: skip


def add_inventory(commands: Any) -> None:
    """numalign inventory MODEL_DIR"""
    inv = subparser(
        commands,
        "inventory",
        help="the catalogue operators a model needs, and which are covered (no weights read)",
        description="Builds the model on the meta device from its config, lists its module "
        "types and the aten operators a forward runs, and maps them to catalogue operators: "
        "where each is used, and whether candidates cover it, only the reference, or nothing.",
    )
    inv.add_argument("model_dir", metavar="MODEL_DIR", help="a local Hugging Face model folder")
    inv.add_argument("--format", choices=["md", "json"], default="md", help="output format")
    inv.add_argument(
        "--trust-remote-code", action="store_true",
        help="run the model folder's own Python code (off: transformers' classes only)",
    )  # fmt: skip
    inv.set_defaults(handler=_inventory)


def add_plan(commands: Any) -> None:
    """numalign plan MODEL_DIR"""
    plan = subparser(
        commands,
        "plan",
        help="what capturing and replaying a model will take: memory, ranks, time (no weights "
        "read)",
        description="Builds the model on the meta device from its config and prints, per part "
        "and in total, its weights in the reference and candidate dtypes, the activations, KV "
        "cache and golden set of the capture's requests, the peak memory unstreamed and "
        "streamed (one layer at a time), the pipeline ranks --device-memory needs, and a time "
        "estimate from this machine's measured throughput (docs/plan.md).",
    )
    plan.add_argument("model_dir", metavar="MODEL_DIR", help="a local Hugging Face model folder")
    plan.add_argument("--dtype", default="bfloat16", help="comma list of candidate dtypes to size")
    plan.add_argument(
        "--reference-dtype", default="float32", choices=["float32", "float64"],
        help="dtype the reference (the capture) runs in",
    )  # fmt: skip
    plan.add_argument(
        "--device-memory", default="80GiB", metavar="SIZE",
        help="memory of one device, for the ranks (e.g. 80GiB, 141GB)",
    )  # fmt: skip
    plan.add_argument("--continuation", type=int, default=8, help="as numalign capture's")
    plan.add_argument(
        "--decode-steps", type=int, default=DEFAULT_DECODE_STEPS, help="as numalign capture's"
    )
    plan.add_argument(
        "--long", type=int, default=None, metavar="TOKENS",
        help="as numalign capture's (default: past every length boundary, from the config)",
    )  # fmt: skip
    plan.add_argument(
        "--far", type=int, default=FAR_LENGTH, metavar="TOKENS", help="as numalign capture's"
    )
    plan.add_argument(
        "--max-position", type=int, default=None, metavar="POSITIONS",
        help="as numalign capture's (default: the config's max_position_embeddings)",
    )  # fmt: skip
    plan.add_argument(
        "--trust-remote-code", action="store_true",
        help="run the model folder's own Python code (off: transformers' classes only)",
    )  # fmt: skip
    plan.add_argument(
        "--full-points", nargs="+", metavar="PATTERN",
        help="as numalign capture's: the golden set's size with only these points whole",
    )  # fmt: skip
    plan.add_argument(
        "--sketch-width", type=int, default=DEFAULT_WIDTH, metavar="BUCKETS",
        help="as numalign capture's",
    )  # fmt: skip
    plan.add_argument("--json", action="store_true", help="print JSON (off: tables)")
    plan.add_argument(
        "--no-measure", action="store_true",
        help="measure nothing, estimate no time (by default about half a second measures "
        "this machine's matmul and read throughput)",
    )  # fmt: skip
    plan.set_defaults(handler=_plan)


def add_nightly(commands: Any) -> None:
    """numalign nightly"""
    night = subparser(
        commands,
        "nightly",
        help="recapture sets of changed models, run the suites against the last nightly",
        description="Recaptures the golden set of every model folder whose fingerprint no "
        "longer matches (the previous version is kept under SETS/.versions/), runs the suites "
        "against the previous nightly run as the baseline, and exits non-zero on a failure "
        "or a regression. Models that did not change are not recaptured.",
    )
    night.add_argument("--models", default="golden/models", help="folder of model folders")
    night.add_argument(
        "--sets", default=str(DEFAULT_SETS), help="folder of their golden sets (one per model)"
    )
    night.add_argument("--suites", nargs="+", default=["suites"], help="suite folders to run")
    night.add_argument(
        "--report-dir", default="reports/nightly", help="where the nightly runs and history go"
    )
    # the suites' options, nightly's tier and compile its own: the last tier by default, and
    # a compiled run after the eager one
    options.add_to(night, ["tier"], default=TIERS[-1], choices=TIERS,
                   help=f"case grid size: {', '.join(TIERS)} (default {TIERS[-1]})")  # fmt: skip
    options.add_to(night, ["device", "dtype"])
    options.add_to(
        night, ["compile"],
        help="then run layer and model replay through torch.compile (default backend inductor) "
        "into REPORT_DIR/compiled, against tonight's eager run (ci/nightly.sh does; none: "
        "eager only)",
    )  # fmt: skip
    night.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    night.set_defaults(handler=_nightly)


def add_run(commands: Any) -> None:
    """numalign run MODEL_DIR"""
    run = subparser(
        commands,
        "run",
        help="bring up a model: inventory, capture if needed, the suites, the reports",
        description="Bring-up of one model folder: its inventory; a capture into "
        "SETS/<folder name> unless a set there has the model's fingerprint; then the model "
        "suites on that set alone and the operator tests of the operators the inventory maps "
        "the model to (by exact name); prints this run's report path.",
    )
    run.add_argument("model_dir", metavar="MODEL_DIR", help="a local Hugging Face model folder")
    run.add_argument(
        "--sets", default=str(RUN_SETS),
        help="where the model's golden set is captured and looked for (outside the tracked "
        "golden/sets, which every pytest suites/ run replays)",
    )  # fmt: skip
    run.add_argument("--suites", default="suites", help="the suites folder of a checkout")
    # the suites' options; those run reads itself default to the table's
    options.add_to(run, ["report_dir"], defaults=True)
    options.add_to(run, ["tier"], defaults=True, choices=TIERS)
    options.add_to(run, ["device", "dtype"])
    options.add_to(run, ["engine"], defaults=True, choices=ENGINES)
    options.add_to(run, ["tp", "pp"], defaults=True, type=int)
    options.add_to(run, ["stream"], defaults=True)
    options.add_to(run, ["serving"])
    run.set_defaults(handler=_run)
