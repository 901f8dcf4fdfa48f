"""Inline SVG charts for the drift report: no JavaScript library, no network, small files.
Every label is escaped here; the SVG is inserted into the page as it is."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b")


@dataclass
class Series:
    name: str
    values: Sequence[float | None]
    color: str = PALETTE[0]
    dashed: bool = False


#: A y axis spanning this many decades or fewer also has ticks at 2 and 5 of each decade
#: (more would crowd the 210-pixel plot: 3 ticks a decade at 4 decades is 12 labels).
_MINOR_TICK_DECADES = 3


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def empty_caption(title: str, series: Sequence[Series]) -> str:
    """What a chart with nothing to draw says instead: that every value is exactly 0 (a
    candidate that matches bit for bit has no use of budget to put on a log axis), or that
    nothing was recorded."""
    values = [v for s in series for v in s.values if v is not None]
    if values and all(v == 0 for v in values):
        why = f"every one of the {len(values)} values is exactly 0 (bit-exact): nothing to draw"
    elif values:
        why = "no finite positive value to draw on a log axis"
    else:
        why = "no record has a value for this chart"
    return f'<p class="empty chart-caption">{escape(title)}: {why}.</p>'


@dataclass(frozen=True)
class _Frame:
    """The plot area of a chart and its scales: x by category index, y by log10 of value."""

    left: int
    top: int
    plot_w: int
    plot_h: int
    n: int
    lo: int
    hi: int

    def x(self, i: int) -> float:
        return self.left + (self.plot_w * (i + 0.5) / self.n)

    def y(self, v: float) -> float:
        return self.top + self.plot_h * (self.hi - math.log10(v)) / (self.hi - self.lo)


def _y_ticks(f: _Frame) -> list[str]:
    parts = []
    minor = (2.0, 5.0) if f.hi - f.lo <= _MINOR_TICK_DECADES else ()
    for p in range(f.lo, f.hi + 1):
        for mantissa in (1.0, *minor):
            if p == f.hi and mantissa > 1.0:
                break
            yy = f.y(mantissa * 10.0**p)
            label = f"1e{p}" if mantissa == 1.0 else _fmt(mantissa * 10.0**p)
            parts.append(
                f'<line x1="{f.left}" x2="{f.left + f.plot_w}" y1="{yy:.1f}" y2="{yy:.1f}" '
                f'class="grid{"" if mantissa == 1.0 else " minor"}"/>'
            )
            parts.append(
                f'<text x="{f.left - 6}" y="{yy + 4:.1f}" class="tick" text-anchor="end">'
                f"{label}</text>"
            )
    return parts


def _x_ticks(f: _Frame, x_labels: Sequence[str], y_label: str) -> list[str]:
    parts = []
    step = max(1, math.ceil(f.n / 24))
    for i in range(0, f.n, step):
        label = escape(x_labels[i][-28:])
        parts.append(
            f'<text transform="translate({f.x(i):.1f},{f.top + f.plot_h + 10}) rotate(40)" '
            f'class="tick">{label}</text>'
        )
    parts.append(
        f'<text transform="translate(14,{f.top + f.plot_h / 2:.0f}) rotate(-90)" class="axis" '
        f'text-anchor="middle">{escape(y_label)} (log)</text>'
    )
    return parts


def _threshold(f: _Frame, threshold: tuple[float, str]) -> list[str]:
    ty = f.y(threshold[0])
    return [
        f'<line x1="{f.left}" x2="{f.left + f.plot_w}" y1="{ty:.1f}" y2="{ty:.1f}" '
        'class="threshold" stroke="#111" stroke-width="1.5" stroke-dasharray="8 4"/>',
        f'<text x="{f.left + f.plot_w - 4}" y="{ty - 5:.1f}" class="tick" text-anchor="end">'
        f"{escape(threshold[1])}</text>",
    ]


def _marker(f: _Frame, marker: tuple[int, str]) -> list[str]:
    mx = f.x(marker[0])
    return [
        f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="{f.top}" y2="{f.top + f.plot_h}" class="marker" '
        'stroke="#c62828" stroke-width="2"/>',
        f'<text x="{mx + 4:.1f}" y="{f.top + 12}" class="marker-label" fill="#c62828">'
        f"{escape(marker[1])}</text>",
    ]


def _series(f: _Frame, s: Series, k: int, x_labels: Sequence[str]) -> list[str]:
    """One series' path, its points with their tooltips, and its legend entry (the ``k``-th)."""
    points = [
        (f.x(i), f.y(v), v, i)
        for i, v in enumerate(s.values)
        if v is not None and v > 0 and math.isfinite(v)
    ]
    if not points:
        return []
    path = " ".join(
        f"{'M' if j == 0 else 'L'}{px:.1f},{py:.1f}" for j, (px, py, _, _) in enumerate(points)
    )
    dash = ' stroke-dasharray="6 4"' if s.dashed else ""
    parts = [f'<path d="{path}" fill="none" stroke="{s.color}" stroke-width="2"{dash}/>']
    for px, py, v, i in points:
        parts.append(
            f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.5" fill="{s.color}">'
            f"<title>{escape(s.name)} @ {escape(x_labels[i])}: {_fmt(v)}</title></circle>"
        )
    ly = f.top + 14 + 18 * k
    legend_x = f.left + f.plot_w
    parts.append(
        f'<line x1="{legend_x + 12}" x2="{legend_x + 36}" y1="{ly}" y2="{ly}" '
        f'stroke="{s.color}" stroke-width="2"{dash}/>'
    )
    parts.append(
        f'<text x="{legend_x + 42}" y="{ly + 4}" class="legend">{escape(s.name[:34])}</text>'
    )
    return parts


def line_chart(
    series: Sequence[Series],
    x_labels: Sequence[str],
    *,
    title: str,
    y_label: str,
    width: int = 880,
    height: int = 280,
    threshold: tuple[float, str] | None = None,
    marker: tuple[int, str] | None = None,
) -> str:
    """A line chart with a log10 y axis; values <= 0 or None are gaps. ``threshold`` (value,
    label) draws a dashed horizontal line (the budget); ``marker`` (x index, label) a vertical
    one (the first divergence). With nothing to draw, a caption says why instead (every value
    exactly 0, or none recorded), never an empty frame. The y axis has a tick at every decade,
    and at 2 and 5 within a decade where it spans three decades or fewer."""
    left, right, top, bottom = 70, 240, 28, 70
    positive = [v for s in series for v in s.values if v is not None and v > 0 and math.isfinite(v)]
    if not positive or not x_labels:
        return empty_caption(title, series)
    if threshold is not None:
        positive.append(threshold[0])
    lo = math.floor(math.log10(min(positive)))
    hi = math.ceil(math.log10(max(positive)))
    frame = _Frame(
        left, top, width - left - right, height - top - bottom, len(x_labels), lo,
        hi if hi > lo else lo + 1,
    )  # fmt: skip
    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
        f'<text x="{left}" y="16" class="chart-title">{escape(title)}</text>',
        *_y_ticks(frame),
        *_x_ticks(frame, x_labels, y_label),
    ]
    if threshold is not None:
        parts += _threshold(frame, threshold)
    if marker is not None and 0 <= marker[0] < frame.n:
        parts += _marker(frame, marker)
    for k, s in enumerate(series):
        parts += _series(frame, s, k, x_labels)
    parts.append("</svg>")
    return "".join(parts)


def budget_color(used: float | None) -> str:
    """Green well inside the budget, amber near it, red beyond it (log scale of use)."""
    if used is None or not math.isfinite(used):
        return "#b71c1c" if used is not None else "#eeeeee"
    if used > 1.0:
        return "#d32f2f"
    t = min(1.0, max(0.0, used)) ** 2  # 0 -> green, 0.5 -> yellow-green, 1 -> amber
    r = int(56 + t * (245 - 56))
    g = int(142 + t * (180 - 142))
    b = int(60 - t * 60)
    return f"#{r:02x}{g:02x}{b:02x}"
