"""drift.html in a real browser (Debian's chromium driven by playwright), offline."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

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


def test_drift_report_renders_sorts_and_filters_offline(
    browser,
    tmp_path: Path,
    run_records: list[dict],  # type: ignore[no-untyped-def]
) -> None:
    import json

    run = tmp_path / "run"
    run.mkdir()
    with (run / "records.jsonl").open("w") as fh:
        for r in run_records:
            fh.write(json.dumps(r) + "\n")
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
    assert errors == [] and blocked == []
    # charts render: the model curves and the heatmap
    assert page.locator(".chart-box:not([hidden]) svg path").count() >= 2
    assert page.locator("#heatmap td.cell").count() >= 6
    # the metric selector switches the visible chart
    page.locator("input[name=metric][value=rel_l2]").check()
    assert page.locator(".chart-box[data-metric=rel_l2]:not([hidden])").count() == 1
    # the table: worst first, sorts on click, filters on input
    rows = page.locator("#offenders tbody tr")
    total = rows.count()
    assert total == len(run_records)
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
