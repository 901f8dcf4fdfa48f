"""numalign report: render a run's reports, or merge runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from numalign.cli.common import subparser
from numalign.session.option_values import DEFAULT_REGRESSION_FACTOR


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
    from numalign.compare.policy import load_policy

    rendered = render_run(
        run_dir,
        baseline=baseline,
        factor=args.factor,
        history=Path(args.history) if args.history else None,
        append=False,
        # the thresholds of the project it runs in (its pyproject.toml), as the session's
        thresholds=load_policy(Path("pyproject.toml")).thresholds,
    )
    for path in rendered.written:
        print(path)
    verdict = rendered.verdict
    for note in verdict.notes if verdict else []:  # what the records lack or did not judge
        print(f"numalign report: {note}", file=sys.stderr)
    unsure = verdict is not None and verdict.verdict in ("incomplete", "not judged")
    if rendered.diff is not None:
        print(f"{len(rendered.diff.regressed)} regression(s) against {baseline}")
        if rendered.diff.regressed and args.fail_on_regression:
            return 1
    return 1 if unsure else 0


def _existing(paths: list[Path]) -> list[Path]:
    missing = [p for p in paths if not (p / "records.jsonl").is_file()]
    if missing:
        raise SystemExit(
            f"numalign report: no records.jsonl in {', '.join(map(str, missing))}: give run "
            "folders as written under --report-dir (reports/<run-id>/)"
        )
    return paths


def add_report(commands: Any) -> None:
    """numalign report RUN | report merge RUN... --out DIR"""
    report = subparser(
        commands,
        "report",
        help="render a run's drift report (or merge runs: report merge RUN... --out DIR)",
        description="Re-renders drift.html, drift.csv and summary.json of a run folder, "
        "optionally against a baseline run; 'report merge RUN... --out DIR' first joins "
        "the records of several runs (shards, machines) into DIR.",
    )
    report.add_argument("paths", nargs="+", metavar="RUN", help="a run folder, or: merge RUN...")
    report.add_argument(
        "--baseline", help="a run folder or records.jsonl to compare against (none: no diff)"
    )
    report.add_argument(
        "--factor", type=float, default=DEFAULT_REGRESSION_FACTOR,
        help="a record regresses when its use of budget grows beyond this factor",
    )  # fmt: skip
    report.add_argument(
        "--history", help="history file whose trend the report draws (none: no trend)"
    )
    report.add_argument("--out", help="output run folder of 'report merge' (required there)")
    report.add_argument(
        "--fail-on-regression", action="store_true", help="exit 1 on regressions (off: exit 0)"
    )
    report.set_defaults(handler=_report)
