"""The HTML drift report's content: escaping, sections, self-containment."""

from __future__ import annotations

import json
import re

from numalign.record import DriftRecord
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
