"""The numalign command line. Every command calls the public library API only."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from numalign import __version__

    parser = argparse.ArgumentParser(
        prog="numalign",
        description="Numerical alignment and regression suite for LLMs on AI accelerators. "
        "The suites run under pytest: pytest -n auto suites/",
    )
    parser.add_argument("--version", action="version", version=f"numalign {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    handler = getattr(args, "handler", None)
    if handler is None:  # pragma: no cover - every registered command sets a handler
        parser.error(f"command {args.command!r} has no handler")
    return int(handler(args))


if __name__ == "__main__":
    sys.exit(main())
