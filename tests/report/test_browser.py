"""drift.html in a real browser (Debian's chromium driven by playwright), offline."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from numalign.records.drift import DriftRecord, write_records
from numalign.report import render_run

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser():  # type: ignore[no-untyped-def]
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        yield browser
        browser.close()


def _open(  # type: ignore[no-untyped-def]
    browser, run: Path, records: list[DriftRecord], height: int = 1800, width: int = 1300, **render
):
    """Renders ``records`` into ``run`` and opens drift.html with every network request
    blocked; returns the page and the lists of console errors and blocked requests."""
    run.mkdir()
    write_records(run / "records.jsonl", records)
    render_run(run, **render)
    page = browser.new_page(viewport={"width": width, "height": height})
    errors: list[str] = []
    blocked: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))

    def route(r):  # type: ignore[no-untyped-def]
        if r.request.url.startswith("file:"):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.goto((run / "drift.html").as_uri())
    return page, errors, blocked


def _message_opens(page) -> None:  # type: ignore[no-untyped-def]
    """A followed link to a failure message opens it, once: the page opens it on the
    ``hashchange`` event, which the browser fires after the click returns (counting at once
    raced it)."""
    opened = page.locator("details[open] pre")
    opened.first.wait_for(state="visible", timeout=5_000)  # 5 s: the event takes milliseconds
    assert opened.count() == 1


def test_drift_report_renders_sorts_and_filters_offline(
    browser,
    tmp_path: Path,
    run_records: list[DriftRecord],  # type: ignore[no-untyped-def]
) -> None:
    run = tmp_path / "run"
    page, errors, blocked = _open(browser, run, run_records)
    assert errors == [] and blocked == []
    # charts render: the model curves and the heatmap
    assert page.locator(".chart-box:not([hidden]) svg path").count() >= 2
    assert page.locator("#heatmap td.cell").count() >= 6
    # the mode selector switches the visible chart
    page.locator("input[name=metric][value=isolated]").check()
    assert page.locator(".chart-box[data-metric=isolated]:not([hidden])").count() == 1
    assert page.locator(".chart-box[data-metric=accumulated]:not([hidden])").count() == 0
    # the table: worst first, sorts on click, filters on input
    rows = page.locator("#offenders tbody tr")
    total = rows.count()
    assert total == len([r for r in run_records if r.verdict != "skipped"])
    assert rows.first.locator("td").nth(2).inner_text() == "failed"
    page.locator("#offenders th[data-key=point]").click()
    points = [rows.nth(i).locator("td").nth(4).inner_text() for i in range(total)]
    assert points == sorted(points, key=str.lower) or points == sorted(points)
    page.locator("#filter").fill("softmax")
    assert 0 < rows.count() < total
    assert all("softmax" in rows.nth(i).inner_text() for i in range(rows.count()))
    page.locator("#filter").fill("")
    # a failure links to its message
    page.locator("#offenders a[href^='#msg-']").first.click()
    _message_opens(page)
    page.screenshot(path=str(run / "drift.png"), full_page=True)
    assert (run / "drift.png").stat().st_size > 10_000
    assert errors == [] and blocked == []
    shutil.copy(run / "drift.png", tmp_path / "drift-screenshot.png")
    page.close()


def test_a_deep_model_report_is_readable(
    browser,
    tmp_path: Path,
    deep_records: list[DriftRecord],  # type: ignore[no-untyped-def]
) -> None:
    run = tmp_path / "deep"
    page, errors, blocked = _open(browser, run, deep_records)
    assert errors == [] and blocked == []
    chart = page.locator(".chart-box:not([hidden]) svg")
    assert chart.count() == 1  # the accumulated chart of the one stack of layers
    # one series per kind of point, the budget's 1.0 line, the first divergence marked
    legend = chart.locator("text.legend").all_text_contents()
    assert legend == ["block", "attention", "mlp", "norm"]
    assert chart.locator("line.threshold").count() == 1
    assert chart.locator("line.marker").count() == 1
    assert "first divergence: model.layers.9.input_layernorm" in (chart.text_content() or "")
    # the x axis is the layer index, every layer drawn: one point per layer and kind
    assert chart.locator("circle").count() == 4 * 32
    box = chart.bounding_box()
    assert box is not None and box["width"] <= 900  # fits the page at 30+ layers
    # logits and continuation: one row per request, the failing logits named
    section = page.locator("#logits tbody tr")
    assert section.count() == 2
    assert "failed" in section.first.inner_text() and "8 tokens agree" in section.first.inner_text()
    # messages: one per failing test, not one per request or point
    assert page.locator("#messages details").count() == 1
    assert "failing records" in page.locator("#messages summary").first.inner_text()
    page.locator("#curves").screenshot(path=str(run / "curves.png"))
    page.screenshot(path=str(run / "drift.png"), full_page=True)
    assert (run / "curves.png").stat().st_size > 10_000
    shutil.copy(run / "curves.png", tmp_path / "deep-curves.png")
    assert errors == [] and blocked == []
    page.close()


#: The reviewer's first screen: a laptop's browser window below its toolbars.
FIRST_SCREEN = {"width": 1300, "height": 900}


def _first_minute_records(run_records: list[DriftRecord]) -> list[DriftRecord]:
    """The run a reviewer opens: operator failures, a decode failing from step 2, an
    expected failure, and a float32 model whose every use of budget is exactly 0."""
    from tests.report.conftest import model_records, operator_record

    records = list(run_records)
    decode = "suites/models/test_decode.py::test_decode[tiny-llama-bfloat16-dynamic]"
    for step in range(4):
        for point in ("model.layers.0.self_attn", "model.layers.1.mlp"):
            scale = 0.001 if step < 2 else 0.2
            r = operator_record(point, "bfloat16", scale, case=f"s{step}").with_fields(
                suite="models", model="tiny-llama", mode="decode", step=step,
                request="text-leftpad", test_id=decode, candidate="transformers",
            )  # fmt: skip
            records.append(r.with_fields(outcome="failed"))
    paged = "suites/models/test_decode.py::test_decode[tiny-llama-bfloat16-paged]"
    known = operator_record("model.layers.0.self_attn", "bfloat16", 0.2, case="p").with_fields(
        suite="models", model="tiny-llama", mode="decode", step=1, test_id=paged,
        outcome="xfailed",
        # a known divergence's reason is long (its signature's evidence): it wraps in its cell
        xfail_reason="paged kernel rounds twice (issue 9): " + "the evidence, " * 300,
    )  # fmt: skip
    records.append(known)
    exact = model_records("tiny-exact", "float32", layers=3)
    for r in exact:  # bit-exact: every comparison passes with no use of its budget
        r.verdict, r.message, r.budget_used = "passed", None, 0.0
    return records + exact


def test_the_first_screen_names_every_failure(  # type: ignore[no-untyped-def]
    browser, tmp_path: Path, run_records: list[DriftRecord]
) -> None:
    import json

    records = _first_minute_records(run_records)
    history = tmp_path / "history.jsonl"
    history.write_text("".join(json.dumps({
        "run_id": f"run{i}", "worst_budget_used": {
            "models": {"tiny-llama": 0.1 * (i + 1), "tiny-llama logits": 0.05},
            "operators": {"gelu": 0.5},
        }}) + "\n" for i in range(3)))  # fmt: skip
    run = tmp_path / "first"
    page, errors, blocked = _open(
        browser, run, records, height=FIRST_SCREEN["height"], history=history
    )
    assert errors == [] and blocked == []
    # the verdict, then every failing test, on the first screen, each linked to its message
    verdict = page.locator(".run-verdict")
    assert verdict.inner_text().startswith("FAILED")
    failing = {r.test_id for r in records if r.status in ("failed", "error", "crashed")}
    rows = page.locator("#failures tbody tr")
    assert {rows.nth(i).locator("td.test").inner_text() for i in range(rows.count())} == failing
    last = rows.nth(rows.count() - 1).bounding_box()
    assert last is not None and last["y"] + last["height"] <= FIRST_SCREEN["height"]
    decode_row = page.locator("#failures tr", has_text="test_decode[tiny-llama-bfloat16-dynamic]")
    cells = decode_row.locator("td").all_inner_texts()
    assert cells[:3] == ["failed", "tiny-llama", "bfloat16"] and cells[6] == "3"  # worst step
    # the expected failure is apart, with its reason, never among the failures
    assert "paged" not in page.locator("#failures").inner_text()
    assert "paged kernel rounds twice (issue 9)" in page.locator("#expected").inner_text()
    # no line is wider than the window: the test column stays on screen
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= FIRST_SCREEN["width"], width
    # a failure's link opens its message
    decode_row.locator("a").click()
    _message_opens(page)
    # the navigation bar reaches every section, and stays on screen while scrolling
    targets = page.locator("nav#nav a").evaluate_all("els => els.map(e => e.hash.slice(1))")
    sections = page.locator("main > section").evaluate_all("els => els.map(e => e.id)")
    assert targets == sections
    page.locator("nav#nav a[href='#trend']").click()
    nav = page.locator("nav#nav").bounding_box()
    assert nav is not None and nav["y"] == 0
    # cards in tests and in records
    assert page.locator(".cards-row").count() == 2
    # decode drift charted by step, the first failing step marked
    page.locator("input[name=metric][value=decode]").check()
    chart = page.locator(".curve[data-model=tiny-llama] .chart-box[data-metric=decode] svg")
    assert chart.count() == 1
    x_ticks = chart.locator("text.tick[transform]").all_text_contents()
    assert x_ticks == ["0", "1", "2", "3"]  # the steps, 0 the prefill's cache
    assert "first failure: step 2" in (chart.text_content() or "")
    # a chart with nothing to draw says why
    exact = page.locator(".curve[data-model=tiny-exact] .chart-box[data-metric=decode]")
    assert exact.count() == 0  # no decode records: no decode chart
    page.locator("input[name=metric][value=accumulated]").check()
    caption = page.locator(".curve[data-model=tiny-exact] .chart-caption").first
    assert "exactly 0" in caption.inner_text()
    # readable axes: ticks within decades where the axis spans few
    assert page.locator("svg .grid.minor").count() > 0
    # the trend: one chart per model or operator, picked by a selector
    options = page.locator("#trend-picker option").all_inner_texts()
    assert options == ["models/tiny-llama", "operators/gelu"]
    assert page.locator(".trend-box:not([hidden])").count() == 1
    page.locator("#trend-picker").select_option("operators/gelu")
    shown = page.locator(".trend-box:not([hidden])")
    assert shown.get_attribute("data-key") == "operators/gelu"
    legend = page.locator(".trend-box[data-key='models/tiny-llama'] text.legend")
    assert legend.all_text_contents() == ["points", "logits"]
    # the model column stays visible when the table scrolls sideways
    page.locator("#offenders-wrap").evaluate("el => { el.scrollLeft = 400; }")
    wrap = page.locator("#offenders-wrap").bounding_box()
    first_cell = page.locator("#offenders tbody tr").first.locator("td").first.bounding_box()
    assert wrap is not None and first_cell is not None
    assert abs(first_cell["x"] - wrap["x"]) <= 2  # stuck at the left edge (border: 1 px)
    page.set_viewport_size(FIRST_SCREEN)
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(run / "first-screen.png"))
    shutil.copy(run / "first-screen.png", tmp_path / "first-screen.png")
    assert errors == [] and blocked == []
    page.close()


#: A smaller laptop's window: the answer must fit it too.
SMALL_SCREEN = {"width": 1280, "height": 800}


def _diverging_records(run_records: list[DriftRecord]) -> list[DriftRecord]:
    """``run_records`` and a model test failing first at ``model.layers.1.mlp``, locally,
    its candidate 2% too large there (a real comparison: its likely cause is a scale) and
    every point after it failing worse; and an operator test with a long id failing with a
    long evidence (each must wrap in its cell, never widen the page)."""
    import torch

    from numalign.compare import CompareSpec, compare

    test_id = "suites/models/test_model.py::test_model[tiny-mistral-bfloat16]"
    gen = torch.Generator().manual_seed(0)
    truth = torch.randn(16, 256, generator=gen, dtype=torch.float64)
    candidate = (truth * 1.02).to(torch.bfloat16)
    point = "model.layers.1.mlp"
    result = compare(candidate, truth, CompareSpec(control=truth.to(torch.bfloat16), name=point))
    first = DriftRecord.from_result(
        result, test_id=test_id, suite="models", model="tiny-mistral", mode="accumulated",
        request="text-leftpad", candidate="transformers", outcome="failed",
    )  # fmt: skip
    first.first_divergence = {"point": first.point, "kind": "local", "request": "text-leftpad"}
    later = [
        first.with_fields(point=f"model.layers.{i}.mlp", budget_used=2.0 * i,
                          first_divergence=None,
                          cause={"label": "precision", "confidence": 0.4, "evidence": "e"})
        for i in range(2, 6)
    ]  # fmt: skip
    long = DriftRecord(
        "suites/operators/test_operators.py::test_rms_norm[fused" + "_fused" * 30 + "-bfloat16-c]",
        suite="operators", point="rms_norm", verdict="failed", outcome="failed", budget_used=9.0,
        cause={"label": "clamp", "confidence": 0.7, "evidence": "the error " * 80 + "at 8"},
    )  # fmt: skip
    return [*run_records, first, *later, long]


def test_the_first_screen_says_where_it_diverged_and_why(  # type: ignore[no-untyped-def]
    browser, tmp_path: Path, run_records: list[DriftRecord]
) -> None:
    records = _diverging_records(run_records)
    first = next(r for r in records if r.first_divergence and r.model == "tiny-mistral")
    assert first.cause is not None and first.cause["label"] == "scale"  # the real comparison's
    run = tmp_path / "diverging"
    page, errors, blocked = _open(browser, run, records, **SMALL_SCREEN)
    assert errors == [] and blocked == []
    row = page.locator("#failures tr", has_text="test_model[tiny-mistral-bfloat16]")
    divergence, cause = row.locator("td.first-divergence"), row.locator("td.cause")
    assert divergence.inner_text() == "model.layers.1.mlp (local)"
    assert cause.inner_text().startswith("scale (0.99)")  # the divergent record's, not the worst's
    assert "explains" in cause.inner_text()  # its evidence, on a second line
    # both on the first screen, unscrolled
    for cell in (divergence, cause):
        box = cell.bounding_box()
        assert box is not None and box["y"] + box["height"] <= SMALL_SCREEN["height"], box
        assert box["x"] + box["width"] <= SMALL_SCREEN["width"], box
    # a long evidence is cut in the cell (whole in its title); the page is never wider than
    # the window: long evidence and test ids wrap in their cells
    long = page.locator("#failures tr", has_text="test_rms_norm").locator("td.cause")
    assert long.inner_text().endswith("\u2026")
    assert long.get_attribute("title") == "the error " * 80 + "at 8"
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= SMALL_SCREEN["width"], width
    # what passed, and what it could see, follows the failures in the same section, and
    # begins on the first screen
    passed = page.locator("#verdict #passed")
    assert "What passed, and what it could see" in passed.inner_text()
    top = passed.bounding_box()
    assert top is not None and top["y"] < SMALL_SCREEN["height"], top
    assert page.locator("#summary #power").count() == 0
    page.screenshot(path=str(run / "first-screen.png"))
    shutil.copy(run / "first-screen.png", tmp_path / "answer-first-screen.png")
    assert errors == [] and blocked == []
    page.close()
