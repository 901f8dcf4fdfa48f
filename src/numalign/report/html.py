"""The self-contained HTML drift report (drift.html): Jinja2 with autoescaping, inline SVG
charts, and a small inline script for the table and the metric selector. No network."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from numalign.report.charts import PALETTE, Series, budget_color, line_chart
from numalign.report.history import group_of

#: Rows of the worst-offenders table embedded in the page (the full set is in drift.csv).
TABLE_ROWS = 1000
#: Failure messages embedded (the rest are in records.jsonl).
MESSAGES = 300
#: Metrics the drift curves can show.
CURVE_METRICS: tuple[tuple[str, str], ...] = (
    ("max_abs", "max abs error"),
    ("rel_l2", "relative L2 error"),
    ("budget_used", "use of budget"),
)


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _summary_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    counts: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for record in records:
        counts[(str(record.get("suite")), str(record.get("dtype")))][
            str(record.get("verdict"))
        ] += 1
    return [
        {"suite": suite, "dtype": dtype, **{v: counts[(suite, dtype)].get(v, 0)
                                            for v in ("passed", "failed", "skipped", "crashed")}}
        for suite, dtype in sorted(counts)
    ]  # fmt: skip


def _heatmap(records: list[dict[str, Any]]) -> dict[str, Any]:
    worst: dict[tuple[str, str], float] = {}
    for record in records:
        if record.get("suite") != "operators":
            continue
        used = _num(record.get("budget_used"))
        if used is None and record.get("verdict") in ("failed", "crashed"):
            used = math.inf
        if used is None:
            continue
        key = (group_of(record), str(record.get("dtype")))
        worst[key] = max(worst.get(key, 0.0), used)
    operators = sorted({k[0] for k in worst})
    dtypes = sorted({k[1] for k in worst})
    rows = []
    for op in operators:
        cells = []
        for dtype in dtypes:
            used = worst.get((op, dtype))
            text = "" if used is None else ("fail" if math.isinf(used) else f"{used:.2g}")
            cells.append({"text": text, "color": budget_color(used)})
        rows.append({"operator": op, "cells": cells})
    return {"dtypes": dtypes, "rows": rows}


def _curves(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model set and dtype, the drift along the capture points, one SVG per metric."""
    by_model: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record.get("suite") == "models" and record.get("mode") and record.get("model"):
            by_model[(str(record["model"]), str(record.get("dtype")))].append(record)
    out = []
    for (model, dtype), items in sorted(by_model.items()):
        order = sorted({(r.get("point_index", 0), r.get("point") or "") for r in items})
        points = [p for _, p in order]
        index = {p: i for i, p in enumerate(points)}
        charts = []
        for metric, label in CURVE_METRICS:
            lines: dict[str, list[float | None]] = {
                "isolated": [None] * len(points),
                "accumulated": [None] * len(points),
                "budget (accumulated)": [None] * len(points),
            }
            for r in items:
                i = index[r.get("point") or ""]
                value = (
                    _num(r.get("budget_used"))
                    if metric == "budget_used"
                    else _num((r.get("metrics") or {}).get(metric))
                )
                if r.get("mode") in lines:
                    lines[str(r["mode"])][i] = value
                if r.get("mode") == "accumulated":
                    limit = (
                        1.0
                        if metric == "budget_used"
                        else _num((r.get("budget") or {}).get(metric))
                    )
                    lines["budget (accumulated)"][i] = limit
            series = [
                Series("isolated", lines["isolated"], PALETTE[0]),
                Series("accumulated", lines["accumulated"], PALETTE[1]),
                Series(
                    "budget (accumulated)", lines["budget (accumulated)"], "#555555", dashed=True
                ),
            ]
            svg = line_chart(series, points, title=f"{model} [{dtype}]: {label}", y_label=label)
            charts.append({"metric": metric, "svg": svg})
        divergence = next((r["first_divergence"] for r in items if r.get("first_divergence")), None)
        out.append({"model": model, "dtype": dtype, "charts": charts, "divergence": divergence})
    return out


def _trend(history: list[dict[str, Any]]) -> str:
    if len(history) < 2:
        return ""
    keys = sorted(
        {
            (suite, group)
            for h in history
            for suite, groups in (h.get("worst_budget_used") or {}).items()
            for group in groups
        }
    )
    keys = keys[: len(PALETTE) * 2]
    series = []
    for k, (suite, group) in enumerate(keys):
        values = [
            _num(((h.get("worst_budget_used") or {}).get(suite) or {}).get(group)) for h in history
        ]
        series.append(
            Series(f"{suite}/{group}", values, PALETTE[k % len(PALETTE)], dashed=k >= len(PALETTE))
        )
    labels = [str(h.get("run_id")) for h in history]
    return line_chart(series, labels, title="worst use of budget per run", y_label="use of budget")


def _table(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    def badness(r: dict[str, Any]) -> float:
        if r.get("verdict") in ("failed", "crashed"):
            return (
                math.inf
                if _num(r.get("budget_used")) is None
                else 1e300 + (_num(r.get("budget_used")) or 0)
            )
        return _num(r.get("budget_used")) or 0.0

    worst = sorted(
        (r for r in records if r.get("verdict") != "skipped"), key=badness, reverse=True
    )[:TABLE_ROWS]
    rows: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for r in worst:
        metrics = r.get("metrics") or {}
        anchor = None
        if r.get("message") and len(messages) < MESSAGES:
            anchor = f"msg-{len(messages)}"
            messages.append(
                {"anchor": anchor, "test_id": r.get("test_id"), "text": r.get("message")}
            )
        rows.append({
            "used": _num(r.get("budget_used")), "verdict": r.get("verdict"),
            "suite": r.get("suite"), "point": r.get("point"), "candidate": r.get("candidate"),
            "dtype": r.get("dtype"),
            "case": r.get("case"), "max_abs": _num(metrics.get("max_abs")),
            "rel_l2": _num(metrics.get("rel_l2")), "ulp_p99": _num(metrics.get("ulp_p99")),
            "test_id": r.get("test_id"), "anchor": anchor,
        })  # fmt: skip
    return rows, messages


def _script_json(value: Any) -> str:
    """JSON for a <script type="application/json"> block: no '<', '>' or '&' survives, so
    nothing in a test id or message can close the element or open a comment."""
    text = json.dumps(value, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(
    records: list[dict[str, Any]],
    summary: dict[str, Any],
    *,
    baseline: dict[str, Any] | None = None,
    history: list[dict[str, Any]] | None = None,
) -> str:
    """The drift report of one run as a single HTML document."""
    from jinja2 import Environment, PackageLoader, select_autoescape

    env = Environment(
        loader=PackageLoader("numalign.report", "templates"),
        autoescape=select_autoescape(["html", "j2"]),
    )
    rows, messages = _table(records)
    fingerprints = sorted(
        {str(r["golden_fingerprint"]) for r in records if r.get("golden_fingerprint")}
    )
    return env.get_template("drift.html.j2").render(
        summary=summary,
        summary_rows=_summary_rows(records),
        heatmap=_heatmap(records),
        curves=_curves(records),
        curve_metrics=CURVE_METRICS,
        baseline=baseline,
        trend_svg=_trend(history or []),
        rows_json=_script_json(rows),
        messages=messages,
        fingerprints=fingerprints,
        record_count=len(records),
        table_rows=len(rows),
    )


def write_html(
    path: Path, records: list[dict[str, Any]], summary: dict[str, Any], **kwargs: Any
) -> Path:
    """Writes drift.html atomically (a partial page never replaces a whole one)."""
    text = render_html(records, summary, **kwargs)
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path
