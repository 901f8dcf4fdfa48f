"""drift.html in a real browser (Debian's chromium driven by playwright), offline."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from numalign.record import DriftRecord, write_records
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


def _open(browser, run: Path, records: list[DriftRecord]):  # type: ignore[no-untyped-def]
    """Renders ``records`` into ``run`` and opens drift.html with every network request
    blocked; returns the page and the lists of console errors and blocked requests."""
    run.mkdir()
    write_records(run / "records.jsonl", records)
    render_run(run)
    page = browser.new_page(viewport={"width": 1300, "height": 1800})
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
    assert rows.first.locator("td").nth(1).inner_text() == "failed"
    page.locator("#offenders th[data-key=point]").click()
    points = [rows.nth(i).locator("td").nth(3).inner_text() for i in range(total)]
    assert points == sorted(points, key=str.lower) or points == sorted(points)
    page.locator("#filter").fill("softmax")
    assert 0 < rows.count() < total
    assert all("softmax" in rows.nth(i).inner_text() for i in range(rows.count()))
    page.locator("#filter").fill("")
    # a failure links to its message
    page.locator("#offenders a[href^='#msg-']").first.click()
    assert page.locator("details[open] pre").count() == 1
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
