"""Atomic report files: written under a temporary name beside the target and renamed over it,
so a full disk or a kill never leaves a torn drift.csv or summary.json (the previous file, if
any, stays whole); the temporary file is removed when the write fails."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["write_atomic", "write_text_atomic"]


def write_atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """Calls ``write(tmp)`` with a temporary path beside ``path``, then renames it to
    ``path``; returns ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
