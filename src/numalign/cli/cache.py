"""numalign cache: the float64 truth cache's size, and pruning it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from numalign.cli.common import subparser


def _cache(args: argparse.Namespace) -> int:
    """numalign cache info | prune: the operator suite's truth cache."""
    from collections import defaultdict

    from numalign.ops.truths import cache_entries, default_truth_folder, prune_truths
    from numalign.session.option_values import parse_size

    folder = Path(args.cache) if args.cache else default_truth_folder(Path.cwd())
    if args.action == "prune":
        try:
            cap = 0 if args.all else parse_size(args.max_size, "--max-size")
        except ValueError as exc:
            raise SystemExit(f"numalign cache prune: {exc}") from None
        removed, freed = prune_truths(folder, cap)
        print(f"{folder}: removed {removed} entries, {freed / 1e6:.1f} MB (least recently used "
              f"first, down to {cap / 1e6:.0f} MB)")  # fmt: skip
        return 0
    entries = cache_entries(folder)
    per_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for path, size, _ in entries:
        per_op[path.parent.name][0] += 1
        per_op[path.parent.name][1] += size
    total = sum(size for _, size, _ in entries)
    print(f"{folder}: {len(entries)} entries, {total / 1e6:.1f} MB")
    for op, (count, size) in sorted(per_op.items(), key=lambda kv: -kv[1][1]):
        print(f"  {op:32} {count:6} entries {size / 1e6:10.1f} MB")
    return 0


def add_cache(commands: Any) -> None:
    """numalign cache info | prune"""
    cache = subparser(
        commands,
        "cache",
        help="the operator suite's truth cache: its size, or trim it",
        description="info: entries and size per operator; prune: remove the least recently "
        "used entries down to --max-size (--all: every entry). A session keeps the cache "
        "under --truth-cache-size (pytest option) by itself.",
    )
    cache.add_argument("action", choices=["info", "prune"], help="info: sizes; prune: trim")
    cache.add_argument(
        "--cache", metavar="DIR",
        help="the truth folder (none: $NUMALIGN_CACHE/truths, else .numalign-cache/truths)",
    )  # fmt: skip
    cache.add_argument(
        "--max-size", default="4GB", metavar="SIZE", help="prune: the size to trim down to"
    )
    cache.add_argument("--all", action="store_true", help="prune: every entry (off: to size)")
    cache.set_defaults(handler=_cache)
