"""The session file of a run (``session.json``): what the pytest session knew of itself, so
that a report rebuilt later from the records (``numalign report RUN``) can say what they lack.

The controller writes it, atomically, with the run's first record (the run's header and the
number of tests selected) and again at the session's end, before the records are closed and
the tables written (``finished``: what pytest counted, how many tests handed records, how many
records arrived). A disk that fills leaves the file as it last was: whole, and telling either
the end or, without ``finished``, that the session never wrote its end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from numalign.core import finite_json
from numalign.report.atomic import write_text_atomic

__all__ = ["SESSION_FILE", "merge_sessions", "read_session", "write_session"]

#: The session file's name inside a run folder.
SESSION_FILE = "session.json"


def write_session(run_dir: Path, session: dict[str, Any]) -> Path:
    """Writes ``run_dir``/session.json atomically (the previous one stays whole on failure).
    Keys: the run's header (``run_id``, device, dtypes, tier, versions, host, python),
    ``selected`` (tests selected, None where unknown), ``finished`` (the session wrote its
    end), and once finished ``tests`` (per outcome, as pytest counts them), ``tests_recorded``
    (tests that handed records) and ``records`` (records received)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(run_dir / SESSION_FILE, finite_json.dumps(session, indent=2) + "\n")


def read_session(run_dir: Path) -> dict[str, Any] | None:
    """The session file of ``run_dir``; None where there is none (a run written before it
    existed, a merge of runs one of which had none, a records file given alone)."""
    path = run_dir / SESSION_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}: not a session file ({exc}); remove it to rebuild the report without "
            "checking the records against their session"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a session file (a JSON object is expected)")
    return data


def merge_sessions(sessions: list[dict[str, Any]], disjoint: bool) -> dict[str, Any]:
    """The session of runs merged (``report.run.merge_runs``): finished where every one is;
    shards (``disjoint``: no test in two runs) add up their tests selected and recorded and
    their records; runs that share tests (a re-run) had at least the most any one had."""
    add = sum if disjoint else max
    merged: dict[str, Any] = {
        "finished": all(s.get("finished") for s in sessions),
        "merged_sessions": len(sessions),
    }
    selected = [s.get("selected") for s in sessions]
    if all(isinstance(n, int) for n in selected):
        merged["selected"] = add(int(n or 0) for n in selected)
    if merged["finished"]:
        for key in ("tests_recorded", "records"):
            merged[key] = add(int(s.get(key) or 0) for s in sessions)
    return merged
