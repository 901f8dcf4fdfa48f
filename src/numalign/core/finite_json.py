"""JSON for numbers that may not be finite: what every record, summary, regression list and
history line of numalign is written with.

Strict JSON has no NaN or Infinity (``json.dumps(allow_nan=False)`` raises on them, and the
bare ``NaN`` token Python writes otherwise is refused by other readers). A metric that is NaN
(a candidate that turned padded rows to NaN) is a finding to report, never a reason to lose
the record, so a non-finite float is written as one of the strings ``"NaN"``, ``"Infinity"``
and ``"-Infinity"`` (JavaScript's and JSON Schema's spelling), and read back as the float
where a number is expected (:func:`decode`). Everything else is written as plain JSON.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

__all__ = ["NON_FINITE", "decode", "dumps", "encode"]

#: The strings a non-finite float is written as, and the float each reads back as.
NON_FINITE: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _word(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def encode(value: Any) -> Any:
    """``value`` with every non-finite float (a real number of any type: numpy's included)
    replaced by its string in NON_FINITE, through dicts, lists and tuples (tuples become
    lists, as JSON has them)."""
    kind = type(value)
    if kind is float:  # the common cases first: numbers.Real's check is slow
        return value if math.isfinite(value) else _word(value)
    if kind is dict:
        return {k: encode(v) for k, v in value.items()}
    if kind is list:
        return [encode(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else _word(number)
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    """The reverse of :func:`encode` for values where numbers are expected: a string of
    NON_FINITE becomes its float, through dicts and lists; anything else is unchanged."""
    if isinstance(value, str):
        return NON_FINITE.get(value, value)
    if isinstance(value, dict):
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON text of ``value`` (``allow_nan=False``) with non-finite floats encoded;
    ``kwargs`` go to ``json.dumps`` (``indent``)."""
    return json.dumps(encode(value), allow_nan=False, **kwargs)
