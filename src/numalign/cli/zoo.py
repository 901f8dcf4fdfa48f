"""numalign zoo: build the embedded tiny model zoo, or sweep transformers' model types."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from numalign.cli.common import subparser
from numalign.golden.store import DEFAULT_SETS


def _sweep(args: argparse.Namespace) -> int:
    from numalign.sweep.build import causal_lm_types
    from numalign.sweep.run import TYPE_TIMEOUT_S, select_types, sweep

    if args.names:
        raise SystemExit("numalign zoo sweep: name types with --types a,b (not positionally)")
    if not (Path(args.suites) / "models").is_dir():
        raise SystemExit(
            f"numalign zoo sweep: --suites {args.suites}: no models/ suite in it; run from the "
            "repository root, or give the suites folder of a numalign checkout"
        )
    if args.baseline and not Path(args.baseline).is_file():
        raise SystemExit(f"numalign zoo sweep: --baseline {args.baseline}: no such file")
    try:
        types = select_types(
            causal_lm_types(args.image_text),
            [t for t in args.types.split(",") if t],
            args.limit,
            args.shard,
        )
    except ValueError as exc:
        raise SystemExit(f"numalign zoo sweep: {exc}") from None
    out = Path(args.out or "reports/sweep")
    chosen = f"--types ({len(types)} types)" if args.types else f"--limit {args.limit or 'none'}"
    rows = sweep(
        types, out.resolve(), Path(args.suites).resolve(),
        timeout=args.timeout or TYPE_TIMEOUT_S, resume=args.resume,
        command=f"numalign zoo sweep {chosen}",
    )  # fmt: skip
    from numalign.sweep.table import changes, read_rows, summary

    moved = changes(read_rows(Path(args.baseline)), rows) if args.baseline else []
    for line in moved:
        print(f"numalign sweep: {line}")
    print(f"numalign sweep: {summary(rows)}; table {out / 'sweep.md'}")
    regressed = [line for line in moved if line.startswith("regression")]
    return 1 if regressed and args.fail_on_regression else 0


def _zoo(args: argparse.Namespace) -> int:
    from numalign.golden.capture_spec import CaptureSpec
    from numalign.golden.zoo import ZOO, build_zoo
    from numalign.replay.ensemble import capture_calibrated

    if args.action == "sweep":
        return _sweep(args)
    specs = {m.name: m for m in ZOO}
    for path in build_zoo(args.out or "golden/models", args.names or None):
        line = f"{path}"
        if args.sets:
            spec = CaptureSpec(progress=False, long=specs[path.name].long)
            golden = capture_calibrated(path, Path(args.sets) / path.name, spec)
            line += f" -> {golden.path} ({len(golden.points)} points)"
        print(line)
    return 0


def add_zoo(commands: Any) -> None:
    """numalign zoo build | sweep"""
    zoo = subparser(commands, "zoo", help="the embedded tiny model zoo, and the day-0 sweep")
    zoo.add_argument(
        "action",
        choices=["build", "sweep"],
        help="build: write the zoo's model folders; sweep: a tiny checkpoint of every "
        "causal-LM type transformers ships, captured, replayed and planted, into a table",
    )
    zoo.add_argument("names", nargs="*", help="zoo models to build (none: all)")
    zoo.add_argument(
        "--out",
        default=None,
        help="where the model folders go (build: golden/models; sweep: reports/sweep, with "
        "sweep.csv and sweep.md)",
    )
    zoo.add_argument(
        "--sets", default=str(DEFAULT_SETS), help="capture their golden sets here ('' not to)"
    )
    zoo.add_argument("--types", default="", help="sweep: comma list of model types (none: all)")
    zoo.add_argument("--limit", type=int, default=None, help="sweep: at most N types")
    zoo.add_argument("--shard", default=None, help="sweep: I/N, every N-th type from the I-th")
    zoo.add_argument(
        "--image-text", action="store_true", help="sweep: the image-text-to-text types too"
    )
    zoo.add_argument("--timeout", type=float, default=None, help="sweep: seconds one type may take")
    zoo.add_argument(
        "--resume", action="store_true", help="sweep: keep the CSV's rows, sweep the rest"
    )
    zoo.add_argument("--baseline", default=None, help="sweep: a previous sweep.csv to diff")
    zoo.add_argument(
        "--fail-on-regression",
        action="store_true",
        help="sweep: exit 1 when a type regressed against --baseline",
    )
    zoo.add_argument("--suites", default="suites", help="sweep: the suites folder")
    zoo.set_defaults(handler=_zoo)
