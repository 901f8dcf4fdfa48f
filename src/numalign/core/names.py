"""Suggestions for mistyped names, for the errors of every lookup."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest of ``choices``, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""
