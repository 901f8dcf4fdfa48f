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

from numalign import finite_json
from numalign.report.atomic import write_text_atomic

__all__ = ["SESSION_FILE", "read_session", "write_session"]

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
    existed, a merged run, a records file given alone)."""
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
