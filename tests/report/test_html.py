"""The HTML drift report's content: escaping, sections, self-containment."""

from __future__ import annotations

import json
import re

from numalign.report.html import render_html

HEADER = {
    "run_id": "r1",
    "device": "cpu",
    "dtypes": ["bfloat16"],
    "tier": "pr",
    "versions": {"torch": "x"},
}


def test_strings_from_tests_are_escaped(run_records: list[dict]) -> None:
    evil = dict(run_records[0])
    evil.update(
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


def test_the_page_fetches_nothing(run_records: list[dict]) -> None:
    html = render_html(run_records, HEADER)
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert "default-src 'none'" in html  # the CSP forbids any fetch


def test_sections_show_what_the_records_hold(run_records: list[dict]) -> None:
    html = render_html(run_records, HEADER, history=[
        {"run_id": "a", "worst_budget_used": {"operators": {"gelu": 0.5}}},
        {"run_id": "b", "worst_budget_used": {"operators": {"gelu": 2.0}}},
    ])  # fmt: skip
    assert html.count('class="chart-box"') == 3  # one model x dtype, three metrics
    assert "First divergence</b> of tiny-llama [bfloat16]: model.layers.5 (accumulated)" in html
    assert '<td class="cell" style="background:' in html  # the heatmap
    assert "worst use of budget per run" in html  # the trend
    assert html.count('<details id="msg-') == 1  # the one failing record's message
