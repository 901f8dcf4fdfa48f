"""A golden set's power as its manifest holds it (``replay.set_power`` measures it)."""

from __future__ import annotations

from typing import Any

from numalign.core.finite_json import decode as _decode_finite

#: A set's power as JSON holds it (``replay.set_power``): {dtype: {point: {output path:
#: {mode: {"scale": s, "bias": b}}}}}, the smallest relative scale and additive bias (in
#: units of the truth's RMS) a pass there would catch (``compare.power.Detectable``);
#: infinity, written "Infinity" (``numalign.core.finite_json``), where none would.
PowerJson = dict[str, dict[str, dict[str, dict[str, dict[str, float]]]]]


def power_from_json(data: Any) -> PowerJson:
    """A set's power from its JSON form ("Infinity" read back as the float); TypeError or
    AttributeError where a level is not an object or a figure not a number."""
    return {
        dtype: {point: {path: {mode: {name: _figure(value) for name, value in figures.items()}
                               for mode, figures in modes.items()}
                        for path, modes in outputs.items()}
                for point, outputs in points.items()}
        for dtype, points in data.items()
    }  # fmt: skip


def _figure(value: Any) -> float:
    number = _decode_finite(value)
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise TypeError(f"a power figure is a number, not {number!r}")
    return float(number)
