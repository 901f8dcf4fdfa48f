"""The golden sets the replays use: those the model suites replay (``suite_sets``: found
under the project's and each --golden folder, one name one set), those replay cannot use with
the message that says why (``unusable_sets``), and a set opened checked fresh against its model
(``open_fresh``), which every replay opens its set with."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from numalign.golden.manifest import GoldenSetError
from numalign.golden.store import DEFAULT_SETS, discover_sets

if TYPE_CHECKING:
    from numalign.golden.store import GoldenSet


def suite_sets(root: Path, extra: Sequence[Path], *, only: bool = False) -> list[Path]:
    """The golden sets the model suites replay: ``root``/golden/sets and each --golden (with
    ``only``, --golden-only: the --golden sets alone). Two different sets of one name are an
    error naming both: their tests would share ids, and one would be replayed for the other."""
    unique: dict[Path, Path] = {}
    for path in discover_sets([*([] if only else [root / DEFAULT_SETS]), *extra]):
        unique.setdefault(path.resolve(), path)
    by_name: dict[str, list[Path]] = {}
    for path in unique.values():
        by_name.setdefault(path.name, []).append(path)
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    if clashes:
        listed = "; ".join(f"{n}: {', '.join(map(str, ps))}" for n, ps in sorted(clashes.items()))
        raise GoldenSetError(
            f"golden sets share a name ({listed}); test ids name a set by its folder's name: "
            "rename one folder, or replay one set alone with --golden SET --golden-only"
        )
    return list(unique.values())


def unusable_sets(paths: Sequence[str | Path]) -> dict[str, str]:
    """Of the golden sets at ``paths``, those replay cannot use (a stale set: its model
    changed since the capture; a missing model folder; a broken manifest), each with the
    message that says why and how to fix it. The model suites fail one test of such a set with
    that message and skip its others, instead of failing every test with it."""
    out: dict[str, str] = {}
    for path in dict.fromkeys(str(p) for p in paths):
        try:
            open_fresh(path)
        except GoldenSetError as exc:
            out[path] = str(exc)
    return out


def open_fresh(path: str | Path) -> GoldenSet:
    """The set (opened once per process while its manifest stays the same), checked that its
    model did not change (StaleGoldenSetError otherwise; the model's fingerprint is hashed
    again only when a file of it changed)."""
    from numalign.golden.store import GoldenSet

    golden = GoldenSet.open_shared(path)
    golden.check_fresh()
    return golden
