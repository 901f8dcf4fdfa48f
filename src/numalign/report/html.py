"""The self-contained HTML drift report (drift.html): Jinja2 with autoescaping, inline SVG
charts, and a small inline script for the table and the metric selector. No network."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from numalign.core import finite_json
from numalign.records.drift import END_MODES, FAILING, STATUSES, DriftRecord
from numalign.report.charts import PALETTE, Series, budget_color, line_chart
from numalign.report.first_screen import (
    cause_text,
    failures,
    golden_sets,
    metric,
    num,
    passes,
    ratchet_rows,
    what,
)
from numalign.report.serving import serving_matrix
from numalign.report.tables import power_by_dtype
from numalign.report.verdict import judge_run

#: Rows of the worst-offenders table embedded in the page (the full set is in drift.csv).
TABLE_ROWS = 1000
#: Tests whose failure messages are embedded (the rest are in records.jsonl).
MESSAGES = 300
#: Failing tests listed at the top of the page (all of them, for any run a reviewer reads
#: whole; a run failing more is broken at its root, and the table below has every record).
FAILURES_LISTED = 200
#: Other failing records listed under a test's message.
MESSAGE_OTHERS = 20
#: Kinds of capture point a layer chart draws, one series each, in this order.
POINT_KINDS: tuple[str, ...] = ("block", "attention", "mlp", "norm", "other")
#: Words in a block's child name that say its kind, the first match wins (norms first:
#: ``post_attention_layernorm`` is a norm).
_KIND_WORDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("norm", ("norm", "ln_")),
    ("attention", ("attn", "attention", "mixer")),
    ("mlp", ("mlp", "moe", "expert", "feed_forward", "ffn", "intermediate", "output")),
)
#: Model-suite modes drawn along the layers, and how the picker names them.
CURVE_MODES: tuple[tuple[str, str], ...] = (
    ("accumulated", "whole model (accumulated)"),
    ("isolated", "each point alone (isolated)"),
    ("decode", "decode, by step"),
)


def _summary_rows(records: list[DriftRecord]) -> list[dict[str, Any]]:
    """Records per suite and dtype of the test (not of each output: an operator's indices
    are int64 in a bfloat16 test), per status."""
    counts: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for record in records:
        counts[(str(record.suite), str(record.test_dtype))][record.status] += 1
    return [
        {"suite": suite, "dtype": dtype, **{v: counts[(suite, dtype)].get(v, 0) for v in STATUSES}}
        for suite, dtype in sorted(counts)
    ]


def _heatmap(records: list[DriftRecord]) -> dict[str, Any]:
    worst: dict[tuple[str, str], float] = {}
    for record in records:
        if record.suite != "operators":
            continue
        if record.status == "xfailed":  # expected: listed apart, not coloured as a failure
            continue
        used = num(record.budget_used)
        if used is None and record.status in FAILING:
            used = math.inf
        if used is None:
            continue
        key = (record.group, str(record.test_dtype))
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


def point_place(point: str) -> tuple[str | None, int | None, str]:
    """Where a capture point sits: (stack, layer index, kind). ``model.layers.3.self_attn``
    is in stack ``model.layers``, layer 3, kind attention; ``model.layers.3`` is the block
    itself; points outside any stack (embeddings, final norm, head) have no layer."""
    parts = point.split(".")
    at = next((i for i, p in enumerate(parts) if p.isdigit() and i > 0), None)
    if at is None:
        return None, None, "other"
    stack, layer, rest = ".".join(parts[:at]), int(parts[at]), parts[at + 1 :]
    if not rest or rest[0].isdigit():  # the block, or an output of the block's tuple
        return stack, layer, "block"
    child = rest[0].lower()
    for kind, words in _KIND_WORDS:
        if any(w in child for w in words):
            return stack, layer, kind
    return stack, layer, "other"


def _curves(records: list[DriftRecord]) -> list[dict[str, Any]]:
    """Per model set, dtype and stack of layers: the use of budget along the layers, one
    series per kind of point (the worst over requests and outputs), the budget's 1.0 line and
    the first divergence marked; one chart per mode (accumulated, isolated)."""
    by_model: dict[tuple[str, str], list[DriftRecord]] = defaultdict(list)
    for record in records:
        if record.suite == "models" and record.model and record.mode in dict(CURVE_MODES):
            by_model[(record.model, str(record.test_dtype))].append(record)
    out = []
    for (model, dtype), items in sorted(by_model.items()):
        stacks: dict[str, int] = defaultdict(int)
        for r in items:
            stack, layer, _ = point_place(r.point or "")
            if stack is not None and layer is not None:
                stacks[stack] = max(stacks[stack], layer + 1)
        divergence = next((r.first_divergence for r in items if r.first_divergence), None)
        charts = []
        for stack in sorted(stacks, key=lambda k: -stacks[k]):
            labels = [str(i) for i in range(stacks[stack])]
            for mode in ("accumulated", "isolated"):
                lines: dict[str, list[float | None]] = {
                    kind: [None] * len(labels) for kind in POINT_KINDS
                }
                for r in items:
                    where, layer, kind = point_place(r.point or "")
                    if r.mode != mode or where != stack or layer is None:
                        continue
                    used = num(r.budget_used)
                    previous = lines[kind][layer]
                    if used is not None and (previous is None or used > previous):
                        lines[kind][layer] = used
                marker = None
                if divergence and mode == "accumulated":
                    where, layer, _ = point_place(str(divergence.get("point")))
                    if where == stack and layer is not None:
                        marker = (layer, f"first divergence: {divergence.get('point')}")
                series = [
                    Series(kind, lines[kind], PALETTE[k % len(PALETTE)])
                    for k, kind in enumerate(POINT_KINDS)
                    if any(v is not None for v in lines[kind])
                ]
                svg = line_chart(
                    series, labels, title=f"{model} [{dtype}] {stack}: use of budget, {mode}",
                    y_label="use of budget", threshold=(1.0, "budget"), marker=marker,
                )  # fmt: skip
                charts.append({"mode": mode, "stack": stack, "svg": svg})
        decode = [r for r in items if r.mode == "decode" and r.step is not None]
        if decode:
            svg = _decode_chart(model, dtype, decode)
            charts.append({"mode": "decode", "stack": "", "svg": svg})
        outside = _outside(items)
        out.append({"model": model, "dtype": dtype, "charts": charts,
                    "divergence": divergence, "outside": outside})  # fmt: skip
    return out


def _decode_chart(model: str, dtype: str, items: list[DriftRecord]) -> str:
    """Decode replay's use of budget by step (0: the prefill's cache, then each generated
    token), one line per kind of point (the worst over layers, requests and caches), the
    budget's 1.0 line and the first failing step marked."""
    steps = sorted({int(r.step) for r in items if r.step is not None})
    at = {step: i for i, step in enumerate(steps)}
    lines: dict[str, list[float | None]] = {kind: [None] * len(steps) for kind in POINT_KINDS}
    first_failing = None
    for r in items:
        if r.step is None:  # a lean pooled over every step
            continue
        i = at[int(r.step)]
        kind = point_place(r.point or "")[2]
        used = num(r.budget_used)
        if used is not None and (lines[kind][i] is None or used > (lines[kind][i] or 0.0)):
            lines[kind][i] = used
        if r.status in FAILING and (first_failing is None or i < first_failing[0]):
            first_failing = (i, f"first failure: step {r.step}, {r.point}")
    series = [
        Series(kind, lines[kind], PALETTE[k % len(PALETTE)])
        for k, kind in enumerate(POINT_KINDS)
        if any(v is not None for v in lines[kind])
    ]
    return line_chart(
        series, [str(s) for s in steps], title=f"{model} [{dtype}] decode: use of budget by step",
        y_label="use of budget", threshold=(1.0, "budget"), marker=first_failing,
    )  # fmt: skip


def _outside(items: list[DriftRecord]) -> list[dict[str, Any]]:
    """The worst use of budget of the points outside every stack (embeddings, final norm,
    LM head), per point and mode."""
    worst: dict[tuple[str, str], float] = {}
    for r in items:
        if point_place(r.point or "")[0] is None and r.mode and r.point:
            used = num(r.budget_used)
            key = (r.point, r.mode)
            if used is not None and used >= worst.get(key, -1.0):
                worst[key] = used
    return [{"point": p, "mode": m, "used": u} for (p, m), u in sorted(worst.items())]


def _end_results(records: list[DriftRecord]) -> list[dict[str, Any]]:
    """Rows of the logits and continuation section: per model, dtype and request, the
    logits' agreement and budget use, the continuation's, and an encoder's final outputs."""
    rows: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for r in records:
        if r.suite != "models" or r.mode not in END_MODES:
            continue
        key = (str(r.model), str(r.test_dtype), str(r.request), str(r.swap or ""))
        row = rows.setdefault(key, {"model": key[0], "dtype": key[1], "request": key[2],
                                    "swap": key[3], "items": []})  # fmt: skip
        m, b = r.metrics, r.budget
        if r.mode == "logits":
            row["logits"] = {
                "verdict": r.status, "used": num(r.budget_used),
                "top1": num(m.get("top1_agreement")), "top5": num(m.get("top5_overlap")),
                "kl": num(m.get("kl_max")), "kl_budget": num(b.get("kl_max")),
                "max_abs": num(m.get("max_abs")), "max_abs_budget": num(b.get("max_abs")),
                "reason": r.reason,
            }  # fmt: skip
        elif r.mode == "continuation":
            row["continuation"] = {
                "verdict": r.status, "steps": m.get("steps"),
                "first": m.get("first_divergence"), "reason": r.reason,
            }  # fmt: skip
        else:
            row["items"].append({"point": r.point, "verdict": r.status,
                                 "used": num(r.budget_used)})  # fmt: skip
    return [rows[k] for k in sorted(rows)]


def _coverage(records: list[DriftRecord]) -> list[dict[str, Any]]:
    """Per model and engine (the records' candidate): the capture points it judged and those
    it has no counterpart for (skipped records of rule ``unmapped``, with their reasons)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        if r.suite != "models" or r.mode in END_MODES or not r.point:
            continue
        key = (str(r.model), str(r.candidate or "transformers"))
        row = rows.setdefault(key, {"model": key[0], "engine": key[1], "judged": set(),
                                    "unmapped": {}})  # fmt: skip
        if r.rule == "unmapped":
            row["unmapped"][r.point] = r.reason or ""
        elif r.verdict != "skipped":
            row["judged"].add(r.point.removesuffix(".residual"))
    out = []
    for key in sorted(rows):
        row = rows[key]
        unmapped = {p: why for p, why in row["unmapped"].items() if p not in row["judged"]}
        out.append({"model": row["model"], "engine": row["engine"], "judged": len(row["judged"]),
                    "unmapped": sorted(unmapped.items())})  # fmt: skip
    return out


def _trend(history: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One chart per model or operator (what a selector picks): its worst use of budget per
    run, one line each for its points and, for a model, its logits, continuation and final
    outputs; runs that did not test it are gaps."""
    if len(history) < 2:
        return []
    keys = sorted(
        {
            (suite, group)
            for h in history
            for suite, groups in (h.get("worst_budget_used") or {}).items()
            for group in groups
        }
    )
    charts: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    for suite, group in keys:
        charts[(suite, group.split(" ")[0])].append((suite, group))
    labels = [str(h.get("run_id")) for h in history]
    out = []
    for (suite, subject), members in sorted(charts.items()):
        series = []
        for k, (_, group) in enumerate(members):
            values = [
                num(((h.get("worst_budget_used") or {}).get(suite) or {}).get(group))
                for h in history
            ]
            name = group.partition(" ")[2] or ("points" if suite == "models" else subject)
            series.append(Series(name, values, PALETTE[k % len(PALETTE)]))
        title = f"{suite}/{subject}: worst use of budget per run"
        svg = line_chart(series, labels, title=title, y_label="use of budget",
                         threshold=(1.0, "budget"))  # fmt: skip
        out.append({"key": f"{suite}/{subject}", "svg": svg})
    return out


def _table(records: list[DriftRecord]) -> list[dict[str, Any]]:
    def badness(r: DriftRecord) -> float:
        if r.status in FAILING:
            used = num(r.budget_used)
            return math.inf if used is None else 1e300 + used
        return num(r.budget_used) or 0.0

    worst = sorted((r for r in records if r.verdict != "skipped"), key=badness, reverse=True)
    rows: list[dict[str, Any]] = []
    for r in worst[:TABLE_ROWS]:
        m = r.metrics
        found = r.detectable if isinstance(r.detectable, dict) else {}
        cause = r.cause if isinstance(r.cause, dict) and r.status in FAILING else {}
        rows.append({
            "used": num(r.budget_used), "verdict": r.status, "what": what(r),
            "suite": r.suite, "point": r.point, "candidate": r.candidate,
            "dtype": r.test_dtype, "case": r.request or r.case, "step": r.step,
            "swap": r.swap, "max_abs": metric(m.get("max_abs")),
            "rel_l2": metric(m.get("rel_l2")), "ulp_p99": metric(m.get("ulp_p99")),
            "scale_caught": metric(found.get("scale")), "bias_caught": metric(found.get("bias")),
            "cause": cause_text(cause), "cause_evidence": cause.get("evidence") or "",
            "test_id": r.test_id, "anchor": None,
        })  # fmt: skip
    return rows


def _messages(records: list[DriftRecord], *row_lists: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Failure messages grouped per test: the worst failing record's message, then the other
    failing records of the test (point, request, use of budget), not every request again.
    Failures come first; an expected failure (xfailed) follows, labelled with its reason.
    Rows of ``row_lists`` get the anchor of their test's message."""
    by_test: dict[str, list[DriftRecord]] = defaultdict(list)
    for r in records:
        if (r.status in FAILING or r.status == "xfailed") and r.message:
            by_test[r.test_id].append(r)
    anchors: dict[str, str] = {}
    out: list[dict[str, Any]] = []

    def badness(r: DriftRecord) -> float:  # no use of budget (shape, error): the worst
        used = num(r.budget_used)
        return math.inf if used is None else used

    def rank(kv: tuple[str, list[DriftRecord]]) -> tuple[bool, float]:
        expected = all(r.status == "xfailed" for r in kv[1])
        return (expected, -max(badness(r) for r in kv[1]))

    for test_id, failing in sorted(by_test.items(), key=rank)[:MESSAGES]:
        failing.sort(key=lambda r: -badness(r))
        anchor = anchors[test_id] = f"msg-{len(out)}"
        others = [
            {"point": r.point, "request": r.request or r.case, "used": num(r.budget_used),
             "verdict": r.status}
            for r in failing[1 : 1 + MESSAGE_OTHERS]
        ]  # fmt: skip
        out.append({"anchor": anchor, "test_id": test_id, "text": failing[0].message,
                    "verdict": failing[0].status, "count": len(failing), "others": others,
                    "more": max(0, len(failing) - 1 - MESSAGE_OTHERS),
                    "expected": failing[0].xfail_reason if failing[0].status == "xfailed"
                    else None})  # fmt: skip
    for rows in row_lists:
        for row in rows:
            row["anchor"] = anchors.get(str(row["test_id"]))
    return out


def _colored(variants: dict[str, Any] | None) -> dict[str, Any] | None:
    """The compiled-against-eager rows with the heatmap's colour of each side's use."""
    if variants is None:
        return None
    rows = [
        r | {"eager_color": budget_color(r["eager"]), "compiled_color": budget_color(r["compiled"])}
        for r in variants["rows"]
    ]
    return variants | {"rows": rows}


def _script_json(value: Any) -> str:
    """JSON for a <script type="application/json"> block: no '<', '>' or '&' survives, so
    nothing in a test id or message can close the element or open a comment."""
    text = finite_json.dumps(value)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(
    records: list[DriftRecord],
    summary: dict[str, Any],
    *,
    baseline: dict[str, Any] | None = None,
    history: list[dict[str, Any]] | None = None,
    variants: dict[str, Any] | None = None,
    compiled: dict[str, Any] | None = None,
) -> str:
    """The drift report of one run as a single HTML document. ``variants``: the compiled
    run against the eager one, side by side (``report.variants.side_by_side``); ``compiled``:
    a compiled run's own compile cost (``report.variants.compiled_cost``)."""
    from jinja2 import Environment, PackageLoader, select_autoescape

    env = Environment(
        loader=PackageLoader("numalign.report", "templates"),
        autoescape=select_autoescape(["html", "j2"]),
    )
    rows = _table(records)
    failing = failures(records, FAILING)
    expected = failures(records, ("xfailed",))
    messages = _messages(records, rows, failing, expected)
    tests = dict(summary.get("tests") or {})
    # the run's verdict: render_run's (its session checked), else the records' own
    judged = None if "verdict" in summary else judge_run(records, tests)
    verdict = str(summary["verdict"]) if judged is None else judged.verdict
    notes = list(summary.get("verdict_notes") or []) if judged is None else judged.notes
    power = summary.get("power") or power_by_dtype(records)
    passed = passes(records, power)
    return env.get_template("drift.html.j2").render(
        summary=summary,
        summary_rows=_summary_rows(records),
        passes=passed,
        passes_by_suite=any(row["suite"] for row in passed),
        statuses=STATUSES,
        tests=tests,
        test_total=sum(tests.values()),
        records_by_status={o: sum(1 for r in records if r.status == o) for o in STATUSES},
        run_verdict=verdict,
        verdict_notes=notes,
        failures=failing[:FAILURES_LISTED],
        failures_more=max(0, len(failing) - FAILURES_LISTED),
        expected=expected[:FAILURES_LISTED],
        heatmap=_heatmap(records),
        curves=_curves(records),
        curve_modes=CURVE_MODES,
        end_results=_end_results(records),
        coverage=_coverage(records),
        serving=serving_matrix(records),
        baseline=baseline,
        ratchet=ratchet_rows(baseline),
        variants=_colored(variants),
        compiled=compiled,
        trends=_trend(history or []),
        rows_json=_script_json(rows),
        messages=messages,
        golden_sets=golden_sets(records),
        record_count=len(records),
        table_rows=len(rows),
    )


def write_html(
    path: Path, records: list[DriftRecord], summary: dict[str, Any], **kwargs: Any
) -> Path:
    """Writes drift.html atomically (a partial page never replaces a whole one)."""
    text = render_html(records, summary, **kwargs)
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path
