"""The figures block of docs/measurements.md is what the repository holds:
``ci/readme_figures.py`` collects it, and this test fails when the block is stale."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "readme_figures", ROOT / "ci" / "readme_figures.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_figures_are_the_collected_ones(capsys: pytest.CaptureFixture[str]) -> None:
    figures = _script()
    status = figures.main(["--check"])
    assert status == 0, capsys.readouterr().out


def test_a_stale_block_is_reported_with_what_changed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = _script()
    stale = tmp_path / "measurements.md"
    stale.write_text(f"# x\n{figures.BEGIN}\n| numalign's own tests | 362 |\n{figures.END}\n")
    monkeypatch.setattr(figures, "PAGE", stale)
    monkeypatch.setattr(figures, "figures", lambda: [figures.BEGIN, "| tests | 486 |", figures.END])
    assert figures.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "stale: run python ci/readme_figures.py" in out
    assert "-| numalign's own tests | 362 |" in out and "+| tests | 486 |" in out
    assert figures.main([]) == 0  # rewrites the block in place
    assert stale.read_text() == f"# x\n{figures.BEGIN}\n| tests | 486 |\n{figures.END}\n"


def test_a_page_without_the_block_is_stale(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = _script()
    bare = tmp_path / "measurements.md"
    bare.write_text("# Measurements\n")
    monkeypatch.setattr(figures, "PAGE", bare)
    monkeypatch.setattr(figures, "figures", lambda: [figures.BEGIN, "| tests | 486 |", figures.END])
    assert figures.main(["--check"]) == 1
    assert "+| tests | 486 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="has no figures block"):
        figures.main([])


def test_the_block_lives_on_the_measurements_page() -> None:
    figures = _script()
    assert figures.PAGE == ROOT / "docs" / "measurements.md"
    assert figures.current(figures.PAGE.read_text(encoding="utf-8")) is not None
