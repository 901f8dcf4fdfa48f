"""drift.html's first screen: what failed, where it diverged first and its likely cause,
then what passed and what those passes could see; the golden sets by name and the ratchet's
rows. The cells' number helpers, shared with the rest of the page (``report.html``)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from numalign.records.drift import DriftRecord, outcome_of
from numalign.report.ratchet import growth_text
from numalign.report.tables import power_by_dtype

#: Characters of a likely cause's evidence shown under it in the failures table (the whole
#: evidence is the cell's title): four lines of its narrow cell at most, so that a row stays
#: short and the first screen still lists the failing tests (most evidence is shorter:
#: "error = +2% x value explains 99% of its energy" is 47).
EVIDENCE_SHOWN = 90
#: Rows of each of the ratchet's tables in the page, largest growth first (regressions.json
#: has them all): a recalibrated large model may loosen thousands of points at once.
RATCHET_ROWS = 200
#: Hex digits of a golden set's fingerprint shown in the header: 48 bits, which two of a
#: hundred sets share by chance with odds of about 2e-11, short enough to read by a name.
FINGERPRINT_SHOWN = 12


def num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def metric(value: Any) -> float | None:
    """A metric as the table shows it: a number, NaN and infinities included (the page's
    JSON writes them as finite_json does and the table prints them), else None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else None


def what(r: DriftRecord) -> str:
    """The model, or the operator, a record is about."""
    return r.model or (r.point or "?").split(".")[0]


def failures(records: list[DriftRecord], status: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per test whose records have one of ``status``, its worst such record: what (model or
    operator), dtype, variant, point, request, step, use of budget, the test, how many of its
    records share the status; its first divergence (from whichever of its records carries
    it) and its likely cause (the divergent record's, else the worst record's); worst first
    (no use of budget: an error, the worst)."""
    by_test: dict[str, list[DriftRecord]] = defaultdict(list)
    divergent: dict[str, DriftRecord] = {}
    for r in records:
        if r.status in status:
            by_test[r.test_id].append(r)
        if isinstance(r.first_divergence, dict) and r.first_divergence.get("point"):
            divergent.setdefault(r.test_id, r)

    def badness(r: DriftRecord) -> float:
        used = num(r.budget_used)
        return math.inf if used is None else used

    ranked: list[tuple[float, str, dict[str, Any]]] = []
    for test_id, items in by_test.items():
        worst = max(items, key=badness)
        carrier = divergent.get(test_id)
        divergence = carrier.first_divergence if carrier is not None else None
        cause = _cause_of(carrier) or _cause_of(worst)
        evidence = str(cause.get("evidence") or "")
        ranked.append((badness(worst), test_id, {
            "what": what(worst), "dtype": worst.test_dtype, "swap": worst.swap or "",
            "point": worst.point or "", "request": worst.request or worst.case or "",
            "step": worst.step, "used": num(worst.budget_used), "status": worst.status,
            "test_id": test_id, "count": len(items), "rule": worst.rule or "",
            "reason": worst.xfail_reason if worst.status == "xfailed" else worst.reason,
            "divergence": _divergence(divergence), "divergence_why": _divergence_why(divergence),
            "cause": cause_text(cause), "evidence": evidence, "evidence_short": _short(evidence),
            "anchor": None,
        }))  # fmt: skip
    ranked.sort(key=lambda item: (-item[0], item[1]))
    return [row for _, _, row in ranked]


def _cause_of(record: DriftRecord | None) -> dict[str, Any]:
    """A record's likely cause (``DriftRecord.cause``), or {} where it has none."""
    cause = record.cause if record is not None else None
    return cause if isinstance(cause, dict) and cause.get("label") else {}


def _divergence(d: dict[str, Any] | None) -> str:
    """A first divergence (``Divergence.to_dict``) as the failures table shows it:
    "model.layers.1.mlp (local)"; in decode, "model.layers.0.self_attn, step 3 (decode,
    local)" (step 0 is the prefill's cache; no step: a lean pooled over every step)."""
    if not d or not d.get("point"):
        return ""
    if d.get("kind") == "decode":
        step = d.get("step")
        where = "every step pooled" if step is None else f"step {step}"
        how = ", ".join(str(k) for k in ("decode", d.get("located")) if k)
        return f"{d['point']}, {where} ({how})"
    return f"{d['point']} ({d.get('kind') or 'unlocated'})"


def _divergence_why(d: dict[str, Any] | None) -> str:
    """The rest of a first divergence, for its cell's title: its request, the point at
    fault upstream, the model's own inputs it fails fed, what follows the last point."""
    if not d or not d.get("point"):
        return ""
    parts = [f"request {d['request']}"] if d.get("request") else []
    if d.get("named"):
        parts.append(f"from {d['named']}, which fails alone")
    if d.get("inputs"):
        parts.append("fails fed the model's own " + ", ".join(map(str, d["inputs"])))
    if d.get("why"):
        parts.append(str(d["why"]))
    return "; ".join(parts)


def _short(text: str, limit: int = EVIDENCE_SHOWN) -> str:
    """``text`` cut at a word to at most ``limit`` characters, an ellipsis marking the cut."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1].rsplit(" ", 1)[0].rstrip(" ,;:(")
    return cut + "\u2026"


def passes(records: list[DriftRecord], power: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """What passed, per dtype of the test (and per suite where the run has more than one):
    its passed tests and records, and what those passes could see (``power_by_dtype``: the
    median and worst smallest-caught scale and bias; ``power``, the run's, per dtype alone).
    A dtype where nothing passed has no row."""
    split = len({r.suite for r in records if r.suite}) > 1
    groups: dict[tuple[str, str], list[DriftRecord]] = defaultdict(list)
    for r in records:
        groups[(str(r.suite or "") if split else "", str(r.test_dtype))].append(r)
    outcomes = outcome_of(records)
    rows = []
    for (suite, dtype), items in sorted(groups.items()):
        figures = (power_by_dtype(items) if split else power).get(dtype) or {}
        tests = {r.test_id for r in items if outcomes[r.test_id] == "passed"}
        passed = sum(1 for r in items if r.status == "passed")
        if passed or tests:
            rows.append({"suite": suite, "dtype": dtype, "tests": len(tests), "records": passed,
                         "judged": figures.get("records", 0), "scale": figures.get("scale"),
                         "bias": figures.get("bias")})  # fmt: skip
    return rows


def golden_sets(records: list[DriftRecord]) -> list[dict[str, str]]:
    """The run's golden sets for the header: each by its name (the model of a model suite's
    records) with its short fingerprint after it, "tiny-llama (0fcd69c4553c)"; a set no
    record names keeps its short fingerprint alone. Sorted by what is shown."""
    names: dict[str, set[str]] = defaultdict(set)
    for r in records:
        if r.golden_fingerprint:
            fingerprint = str(r.golden_fingerprint)
            names[fingerprint].update([str(r.model)] if r.model else [])
    sets = []
    for fingerprint, named in names.items():
        short = fingerprint[:FINGERPRINT_SHOWN]
        label = f"{', '.join(sorted(named))} ({short})" if named else short
        sets.append({"label": label, "fingerprint": fingerprint})
    return sorted(sets, key=lambda s: (s["label"], s["fingerprint"]))


def ratchet_rows(baseline: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ratchet's rows of a baseline diff (``report.ratchet``: budgets loosened and power
    lost beyond its factor), each growth written as the terminal writes it
    (``ratchet.growth_text``); None for a diff written before the ratchet (an older
    regressions.json). ``beyond``: the factor as the titles say it, "1.25x"."""
    if not baseline or ("loosened" not in baseline and "weakened" not in baseline):
        return None

    def rows(key: str) -> list[dict[str, Any]]:
        shown = (baseline.get(key) or [])[:RATCHET_ROWS]
        return [row | {"growth_text": growth_text(row)} for row in shown]

    more = {k: max(0, len(baseline.get(k) or []) - RATCHET_ROWS) for k in ("loosened", "weakened")}

    factor = num(baseline.get("ratchet_factor"))
    beyond = f"{factor:g}x" if factor is not None else "the ratchet's factor"
    return {"beyond": beyond, "loosened": rows("loosened"), "weakened": rows("weakened"),
            "more": more}  # fmt: skip


def cause_text(cause: dict[str, Any]) -> str:
    """A failing record's likely cause, as the table shows it: "scale (0.97)"."""
    if not cause.get("label"):
        return ""
    confidence = num(cause.get("confidence"))
    return f"{cause['label']} ({confidence:.2f})" if confidence is not None else cause["label"]
