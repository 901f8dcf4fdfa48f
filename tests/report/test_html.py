"""The HTML drift report's content: escaping, sections, self-containment."""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser
from typing import Any

from numalign.records import testids
from numalign.records.drift import DriftRecord
from numalign.report.html import point_place, render_html

HEADER = {
    "run_id": "r1",
    "device": "cpu",
    "dtypes": ["bfloat16"],
    "tier": "pr",
    "versions": {"torch": "x"},
}


def test_strings_from_tests_are_escaped(run_records: list[DriftRecord]) -> None:
    evil = run_records[0].with_fields(
        test_id='t[<script>alert("id")</script>]',
        point="<img src=x onerror=alert(1)>",
        verdict="failed",
        message="</script><script>alert('message')</script>",
    )
    html = render_html([evil, *run_records[1:]], HEADER)
    assert "<script>alert" not in html
    assert "<img src=x" not in html
    assert "&lt;script&gt;alert(&#34;id&#34;)" in html or "&lt;script&gt;alert(" in html
    # the table's JSON cannot close its script element
    data = re.search(r'<script type="application/json" id="rows-data">(.*?)</script>', html, re.S)
    assert data is not None
    rows = json.loads(data.group(1))
    assert any(r["point"] == "<img src=x onerror=alert(1)>" for r in rows)


def test_the_page_fetches_nothing(run_records: list[DriftRecord]) -> None:
    html = render_html(run_records, HEADER)
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert "default-src 'none'" in html  # the CSP forbids any fetch


def test_sections_show_what_the_records_hold(run_records: list[DriftRecord]) -> None:
    html = render_html(run_records, HEADER, history=[
        {"run_id": "a", "worst_budget_used": {"operators": {"gelu": 0.5}}},
        {"run_id": "b", "worst_budget_used": {"operators": {"gelu": 2.0}}},
    ])  # fmt: skip
    assert html.count('class="chart-box"') == 2  # one model x dtype x stack, two modes
    assert "First divergence</b> of tiny-llama [bfloat16]: model.layers.5 (accumulated)" in html
    assert html.count('id="logits"') == 1 and "every greedy token agrees" not in html
    assert '<td class="cell" style="background:' in html  # the heatmap
    assert "worst use of budget per run" in html  # the trend
    assert html.count('<details id="msg-') == 1  # the one failing record's message


def test_points_are_placed_by_stack_layer_and_kind() -> None:
    assert point_place("model.layers.3") == ("model.layers", 3, "block")
    assert point_place("model.layers.3.0") == ("model.layers", 3, "block")  # the block's tuple
    assert point_place("model.layers.3.self_attn.0") == ("model.layers", 3, "attention")
    assert point_place("model.layers.12.post_attention_layernorm") == ("model.layers", 12, "norm")
    assert point_place("model.layers.0.mlp") == ("model.layers", 0, "mlp")
    assert point_place("model.visual.blocks.1.attn") == ("model.visual.blocks", 1, "attention")
    assert point_place("encoder.layer.1.intermediate") == ("encoder.layer", 1, "mlp")
    assert point_place("model.norm") == (None, None, "other")
    assert point_place("lm_head") == (None, None, "other")


def test_a_deep_model_has_one_series_per_kind_and_messages_once_per_test(
    deep_records: list[DriftRecord],
) -> None:
    html = render_html(deep_records, HEADER)
    # one chart per mode, each with the budget line; the divergence marked once
    assert html.count('class="chart-box"') == 2
    assert html.count('class="threshold"') == 2
    assert html.count('class="marker"') == 1
    for kind in ("block", "attention", "mlp", "norm"):
        assert f"{kind} @ 31:" in html  # a series point per kind at the last layer
    # failure messages: one per failing test, however many requests and points failed
    failing_tests = {r.test_id for r in deep_records if r.verdict == "failed"}
    assert html.count('<details id="msg-') == len(failing_tests) == 1
    assert "failing records)" in html and "and " in html
    # the logits and continuation section
    section = html[html.index('<section id="logits">') : html.index('<section id="coverage">')]
    assert section.count("<tr><td>deep-llama</td>") == 2  # one row per request
    assert "differs at step" not in section and "8 tokens agree" in section


def test_points_per_engine_count_what_was_judged_and_what_was_not() -> None:
    from numalign.replay.verdict import unmapped_records

    test_id = "suites/models/test_model.py::test_model[tiny-mistral-float32]"
    context = {"suite": "models", "model": "tiny-mistral", "candidate": "vllm"}
    judged = [
        DriftRecord(test_id=test_id, point=p, mode="accumulated", budget_used=0.1, **context)
        for p in ("model.norm", "model.layers.0.input_layernorm", "model.layers.0.mlp")
    ]
    # the residual stream of a fused norm is the norm's point, judged once
    judged.append(judged[1].with_fields(point="model.layers.0.input_layernorm.residual"))
    unmapped = unmapped_records(
        {"model.layers.0.self_attn.q_proj": "vLLM's LlamaForCausalLM has no module ... qkv_proj"},
        test_id, "accumulated", **context,
    )  # fmt: skip
    html = render_html([*judged, *unmapped], HEADER)
    section = html[html.index('<section id="coverage">') : html.index('<section id="regressions">')]
    row = re.sub(r"\s+", " ", section[section.index("<tbody>") :])
    assert '<td>tiny-mistral</td><td>vllm</td><td class="num">3</td><td class="num">1</td>' in row
    reason = "vLLM&#39;s LlamaForCausalLM has no module ... qkv_proj"
    assert f'title="{reason}">model.layers.0.self_attn.q_proj' in row


def test_the_serving_matrix_shows_each_arrangement_per_model_and_dtype() -> None:
    def served(serving: str | None, point: str, used: float, verdict: str = "passed") -> Any:
        text = testids.format_model("tiny-mistral", "float32", serving)
        return DriftRecord(
            test_id=f"suites/models/test_model.py::test_model[{text}]", point=point,
            mode="accumulated", budget_used=used, verdict=verdict, suite="models",
            model="tiny-mistral", candidate="vllm", dtype="float32",
        )  # fmt: skip

    plain = [served(None, "model.norm", 0.2), served("alone", "model.norm", 0.2)]
    assert "serving-matrix" not in render_html(plain[:1], HEADER)  # the default alone: none
    records = [*plain, served("prefix-cached", "model.norm", 0.3),
               served("prefix-cached", "model.layers.0.self_attn", 3.5, "failed")]  # fmt: skip
    parser = _Cells("serving-matrix")
    parser.feed(render_html(records, HEADER))
    header, row = parser.rows
    # the columns in the arrangements' order; a cell: the worst verdict and use of budget
    assert [text for text, _ in header] == ["model", "dtype", "batched", "alone", "prefix-cached"]
    assert [text for text, _ in row] == [
        "tiny-mistral", "float32", "passed 0.2", "passed 0.2", "failed 3.5"
    ]  # fmt: skip


class _Cells(HTMLParser):
    """The rows of one table of a page (by its id): per cell, its text and its title."""

    def __init__(self, table_id: str) -> None:
        super().__init__()
        self.table_id, self.inside, self.cell = table_id, False, None
        self.rows: list[list[tuple[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table" and dict(attrs).get("id") == self.table_id:
            self.inside = True
        elif self.inside and tag == "tr":
            self.rows.append([])
        elif self.inside and tag in ("td", "th"):
            self.cell = ["", dict(attrs).get("title") or ""]
        elif self.inside and tag in ("small", "br") and self.cell is not None:
            self.cell[0] += "\n"  # the cause's evidence: its second line

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self.inside = False
        elif self.inside and tag in ("td", "th") and self.cell is not None:
            self.rows[-1].append((re.sub(r"[ \t]+", " ", self.cell[0]).strip(), self.cell[1]))
            self.cell = None

    def handle_data(self, data: str) -> None:
        if self.cell is not None:
            self.cell[0] += data


def _rows(html: str, table_id: str) -> list[dict[str, tuple[str, str]]]:
    """The body rows of a table as {header: (text, title)}."""
    parser = _Cells(table_id)
    parser.feed(html)
    header = [text for text, _ in parser.rows[0]]
    return [dict(zip(header, row, strict=True)) for row in parser.rows[1:]]


def _answer_records() -> list[DriftRecord]:
    """A run with the answer to show first: a model test failing first at a local point
    (with a likely cause) and worse further on (with another), a decode test whose divergent
    record has no cause, an operator failing (no divergence), and passes that could see."""
    model = "suites/models/test_model.py::test_model[tiny-x-bfloat16]"
    decode = "suites/models/test_decode.py::test_decode[tiny-x-bfloat16-dynamic]"
    at = {"suite": "models", "model": "tiny-x", "golden_fingerprint": "abcdef0123456789" * 4}
    scale = {"label": "scale", "evidence": "error = +2% x value explains 97% of its energy",
             "confidence": 0.97}  # fmt: skip
    first = DriftRecord(model, point="model.layers.1.mlp", mode="accumulated", verdict="failed",
                        budget_used=1.5, request="text-leftpad", cause=scale, **at,
                        first_divergence={"point": "model.layers.1.mlp", "kind": "local",
                                          "request": "text-leftpad"})  # fmt: skip
    later = first.with_fields(
        point="model.layers.2",
        budget_used=4.0,
        first_divergence=None,
        cause={"label": "precision", "evidence": "e", "confidence": 0.4},
    )
    step = DriftRecord(decode, point="model.layers.0.self_attn", mode="decode", step=3,
                       verdict="failed", budget_used=2.0, request="text-leftpad", **at,
                       first_divergence={"point": "model.layers.0.self_attn", "step": 3,
                                         "request": "text-leftpad", "kind": "decode",
                                         "located": "local"})  # fmt: skip
    worst_step = step.with_fields(step=4, budget_used=6.0, first_divergence=None,
                                  cause={"label": "offset", "evidence": "a constant shift",
                                         "confidence": 0.81})  # fmt: skip
    operator = DriftRecord("suites/operators/test_operators.py::test_gelu[fused-bfloat16-c]",
                           suite="operators", point="gelu", verdict="failed", budget_used=3.0,
                           cause={"label": "clamp", "evidence": "at |values| >= 8",
                                  "confidence": 0.6})  # fmt: skip
    passes = [
        DriftRecord(
            f"suites/models/test_layers.py::test_layer[tiny-x/model.layers.{i}-bfloat16]",
            point=f"model.layers.{i}",
            mode="isolated",
            detectable={"scale": 0.004 * (i + 1), "bias": 0.01 * (i + 1)},
            **at,
        )
        for i in range(3)
    ]
    # an all-zero truth cannot be scaled: this pass could catch no scale at all
    zeros = DriftRecord("suites/operators/test_operators.py::test_relu[fused-bfloat16-zeros]",
                        suite="operators", point="relu", detectable={"scale": math.inf,
                                                                     "bias": 0.02})  # fmt: skip
    return [first, later, step, worst_step, operator, *passes, zeros]


def test_the_verdict_opens_on_what_failed_where_and_why_then_what_passed() -> None:
    html = render_html(_answer_records(), HEADER)
    verdict = html[html.index('<section id="verdict">') : html.index('<section id="summary">')]
    rows = {row["test"][0]: row for row in _rows(verdict, "failures")}
    model = rows["suites/models/test_model.py::test_model[tiny-x-bfloat16]"]
    assert model["first divergence"] == ("model.layers.1.mlp (local)", "request text-leftpad")
    # the cause of the record that diverged first, not of the worst one further on
    evidence = "error = +2% x value explains 97% of its energy"
    assert model["likely cause"] == (f"scale (0.97)\n{evidence}", evidence)
    assert model["use of budget"][0] == "4"  # the worst record's use, as before
    decode = rows["suites/models/test_decode.py::test_decode[tiny-x-bfloat16-dynamic]"]
    assert decode["first divergence"][0] == "model.layers.0.self_attn, step 3 (decode, local)"
    assert decode["likely cause"][0] == "offset (0.81)\na constant shift"  # the worst's
    operator = rows["suites/operators/test_operators.py::test_gelu[fused-bfloat16-c]"]
    assert operator["first divergence"] == ("", "")
    assert operator["likely cause"][0] == "clamp (0.60)\nat |values| >= 8"
    # then what passed, with what it could see, in the verdict and not in the summary
    assert verdict.index('id="failures"') < verdict.index("What passed, and what it could see")
    assert html.count('id="power"') == 1 and 'id="power"' in verdict
    power = {(row["suite"][0], row["dtype"][0]): row for row in _rows(verdict, "power")}
    layers = power[("models", "bfloat16")]
    assert layers["passed tests"][0] == "3" and layers["passed records"][0] == "3"
    assert layers["scale caught: median"][0] == "0.008"  # of 0.004, 0.008 and 0.012
    assert layers["scale caught: worst"][0] == "0.012"
    assert layers["bias caught: worst"][0] == "0.03"
    zeros = power[("operators", "bfloat16")]
    assert zeros["scale caught: worst"][0] == "inf" and zeros["passed tests"][0] == "1"
    assert "inf: some pass could catch none" in verdict
    assert "half of these passes" in verdict  # the sentence that says what they mean


def test_the_header_names_each_golden_set_with_its_short_fingerprint() -> None:
    records = _answer_records()
    records.append(DriftRecord("t", golden_fingerprint="0123456789abcdef" * 4))  # no name
    html = render_html(records, HEADER)
    header = html[html.index("<header>") : html.index("</header>")]
    assert "golden sets</dt><dd>2: " in header
    assert f'<span title="{"abcdef0123456789" * 4}">tiny-x (abcdef012345)</span>' in header
    assert ">0123456789ab</span>" in header  # a set no record names: its hash alone


def test_the_ratchet_lists_budgets_loosened_and_power_lost() -> None:
    row = {"test_id": "suites/models/test_model.py::test_model[tiny-x-bfloat16]",
           "point": "model.layers.1.mlp", "output": "0", "dtype": "bfloat16",
           "measure": "max_abs", "baseline": 0.01, "now": 0.016, "growth": 1.6, "records": 2,
           "recaptured": True}  # fmt: skip
    lost = row | {"measure": "scale", "baseline": 0.004, "now": math.inf, "growth": math.inf,
                  "records": 1, "recaptured": False}  # fmt: skip
    diff = {"factor": 2.0, "compared": 9, "regressed": [], "new": [], "vanished": [],
            "recaptured": ["tiny-x"], "path": "b"}  # fmt: skip

    def section(baseline: dict[str, object]) -> str:
        html = render_html(_answer_records(), HEADER, baseline=baseline)
        return html[html.index('<section id="regressions">') : html.index('<section id="trend">')]

    moved = section(diff | {"loosened": [row], "weakened": [lost], "ratchet_factor": 1.25})
    assert "<h3>Budgets loosened beyond 1.25x</h3>" in moved
    title = "Power lost beyond 1.25x (the smallest error a pass would catch grew)"
    assert f"<h3>{title}</h3>" in moved
    (loosened,) = _rows(moved, "ratchet-loosened")
    assert [loosened[k][0] for k in ("point", "measure", "baseline", "now", "growth", "records",
                                     "golden set")] == [
        "model.layers.1.mlp", "max_abs", "0.01", "0.016", "1.6x", "2", "recaptured"]  # fmt: skip
    (weakened,) = _rows(moved, "ratchet-weakened")
    assert [weakened[k][0] for k in ("measure", "now", "growth", "golden set")] == [
        "scale", "inf", "to inf", ""]  # fmt: skip
    assert "No budget loosened and no power lost" not in moved
    only = section(diff | {"loosened": [row], "weakened": [], "ratchet_factor": 1.25})
    assert "No power lost beyond 1.25x." in only and 'id="ratchet-weakened"' not in only
    still = section(diff | {"loosened": [], "weakened": [], "ratchet_factor": 1.25})
    assert "No budget loosened and no power lost beyond 1.25x." in still
    # the real diff's dict (``BaselineDiff.to_dict``): a budget that doubled is a row (2x is
    # beyond the ratchet's factor, 1.5)
    from numalign.report.baseline import diff_runs

    before = DriftRecord("t::test_mlp", point="mlp", budget={"max_abs": 0.01}, budget_used=0.1)
    real = diff_runs([before.with_fields(budget={"max_abs": 0.02})], [before]).to_dict()
    (doubled,) = _rows(section(real | {"path": "b"}), "ratchet-loosened")
    found = [doubled[k][0] for k in ("test", "measure", "growth")]
    assert found == ["t::test_mlp", "max_abs", "2x"]
    older = section(diff)  # a regressions.json written before the ratchet
    assert "No regressions." in older and "loosened" not in older and "Power lost" not in older


def test_the_ratchets_tables_show_the_largest_rows_and_count_the_rest() -> None:
    """A recalibrated large model may loosen thousands of points: the page lists the
    first RATCHET_ROWS of each kind (largest growth first, as the diff sorts them) and
    counts the rest, which regressions.json keeps."""
    from numalign.report.first_screen import RATCHET_ROWS

    rows = [{"test_id": f"t{i}", "point": f"p{i}", "output": "0", "dtype": "float32",
             "measure": "max_abs", "baseline": 1.0, "now": 2.0, "growth": 2.0, "records": 1,
             "recaptured": False} for i in range(RATCHET_ROWS + 5)]  # fmt: skip
    diff = {"factor": 2.0, "compared": 9, "regressed": [], "new": [], "vanished": [],
            "recaptured": [], "path": "b", "loosened": rows, "weakened": [],
            "ratchet_factor": 1.5}  # fmt: skip
    html = render_html(_answer_records(), HEADER, baseline=diff)
    table = html[
        html.index('id="ratchet-loosened"') : html.index(
            "</table>", html.index('id="ratchet-loosened"')
        )
    ]
    assert table.count("<tr>") == RATCHET_ROWS + 1  # the header's row and the rows shown
    assert "and 5 more rows (regressions.json has them all)." in html
