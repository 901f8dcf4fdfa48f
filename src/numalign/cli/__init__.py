"""The numalign command line. Every command calls the public library API only; each
command lives in a module of its own (``capture``, ``golden``, ``report``, ``zoo``,
``bringup`` for inventory, plan, run and nightly, ``cache``), ``common`` holds what they
share."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from numalign.cli.bringup import add_inventory, add_nightly, add_plan, add_run
from numalign.cli.cache import add_cache
from numalign.cli.capture import add_capture
from numalign.cli.common import Formatter
from numalign.cli.golden import add_golden
from numalign.cli.report import add_report
from numalign.cli.zoo import add_zoo


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command. Abbreviations are off everywhere (``--device`` is not
    ``--device-map``), and every option says its default."""
    from numalign import __version__

    parser = argparse.ArgumentParser(
        prog="numalign",
        description="Numerical alignment and regression suite for LLMs on AI accelerators. "
        "The suites run under pytest: pytest -n auto suites/",
        allow_abbrev=False,
        formatter_class=Formatter,
    )
    parser.add_argument("--version", action="version", version=f"numalign {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    add_report(commands)
    add_capture(commands)
    add_inventory(commands)
    add_plan(commands)
    add_nightly(commands)
    add_run(commands)
    add_zoo(commands)
    add_cache(commands)
    add_golden(commands)
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
