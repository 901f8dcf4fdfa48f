"""The sweep's table: one row per model type, appended to a CSV as each type finishes (an
interrupted sweep keeps the rows it finished), rendered as markdown with its date and
versions, and compared with a previous sweep (new types, regressions)."""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SweepRow:
    """One model type's sweep. ``built``: ``yes``, or ``no: transformers' message``;
    ``capture``: ``ok``, ``crash: ...`` or ``-`` (not reached); ``replay``: ``clean``,
    ``N false alarms``, ``crash`` or ``-``, with the tests' counts; ``planted``: the point the
    planted norm was first caught at (``norm``, ``norm inside: NAME`` where the point holds a
    planted norm that capture does not, or ``not a norm`` after it), ``not caught``, or
    why it was not planted; ``seconds``: wall time of the type."""

    type: str
    built: str = "-"
    capture: str = "-"
    replay: str = "-"
    false_alarms: int = 0
    crashes: int = 0
    planted: str = "-"
    seconds: float = 0.0

    @property
    def buildable(self) -> bool:
        return self.built == "yes"

    @property
    def caught_at_norm(self) -> bool:
        """The planted norm's first divergence was a norm, or the point holding it."""
        return self.planted.endswith("(norm)") or "(norm inside: " in self.planted

    @property
    def clean(self) -> bool:
        """Built, captured, replayed with no false alarm and no crash."""
        return (
            self.buildable
            and self.capture == "ok"
            and self.replay.startswith("clean")
            and not self.false_alarms
            and not self.crashes
        )


COLUMNS = [f.name for f in dataclasses.fields(SweepRow)]


def append_row(path: Path, row: SweepRow) -> None:
    """Appends ``row`` to the CSV at ``path`` (its header first where the file is new)."""
    new = not path.is_file() or path.stat().st_size == 0
    with path.open("a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(dataclasses.asdict(row))


def read_rows(path: Path) -> list[SweepRow]:
    """The rows of a sweep CSV (the last row of a type wins: a rerun replaces it)."""
    if not path.is_file():
        return []
    rows: dict[str, SweepRow] = {}
    with path.open(newline="", encoding="utf-8") as f:
        for raw in csv.DictReader(f):
            rows[raw["type"]] = SweepRow(
                type=raw["type"], built=raw["built"], capture=raw["capture"],
                replay=raw["replay"], false_alarms=int(raw["false_alarms"] or 0),
                crashes=int(raw["crashes"] or 0), planted=raw["planted"],
                seconds=float(raw["seconds"] or 0.0),
            )  # fmt: skip
    return list(rows.values())


def summary(rows: Sequence[SweepRow]) -> str:
    """``N types; B built; C of them clean (P%); K crashes; planted caught at a norm in M``."""
    built = [r for r in rows if r.buildable]
    clean = [r for r in built if r.clean]
    at_norm = [r for r in built if r.caught_at_norm]
    planted = [r for r in built if not r.planted.startswith(("-", "no:", "not planted"))]
    share = f"{100 * len(clean) / len(built):.0f}%" if built else "n/a"
    return (
        f"{len(rows)} types; {len(built)} built; {len(clean)} of them clean ({share}); "
        f"{sum(r.crashes for r in rows)} crashes; planted norm caught at a norm in "
        f"{len(at_norm)} of {len(planted)} planted"
    )


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(rows: Sequence[SweepRow], heading: str) -> str:
    """The table as markdown under ``heading`` (the date, versions and command)."""
    lines = [heading, "", summary(rows), "", "| " + " | ".join(COLUMNS) + " |"]
    lines.append("|" + "---|" * len(COLUMNS))
    for row in rows:
        values = dataclasses.asdict(row)
        values["seconds"] = f"{row.seconds:.0f}"
        lines.append("| " + " | ".join(_cell(values[c]) for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def changes(previous: Iterable[SweepRow], current: Iterable[SweepRow]) -> list[str]:
    """What changed since a previous sweep: types new to it, and regressions (a type that was
    clean is not, or one that built no longer does)."""
    before = {r.type: r for r in previous}
    out = []
    for row in current:
        old = before.get(row.type)
        if old is None:
            out.append(f"new type {row.type}: {'clean' if row.clean else row.replay}")
        elif old.clean and not row.clean:
            out.append(f"regression {row.type}: was clean, now {row.capture} / {row.replay}")
        elif old.buildable and not row.buildable:
            out.append(f"regression {row.type}: built before, now {row.built}")
    return out
