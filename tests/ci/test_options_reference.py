"""docs/reference/options.md and cli.md are what the option table and the parser say:
``ci/options_reference.py`` writes them, and this test fails when either is stale."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "options_reference", ROOT / "ci" / "options_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_is_the_option_table_and_the_parser(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = _script().main(["--check"])
    assert status == 0, capsys.readouterr().out


def test_every_option_and_command_is_in_the_reference() -> None:
    from numalign.cli import build_parser
    from numalign.session.options import OPTIONS

    script = _script()
    options = script.options_markdown()
    assert all(f"`{o.ini}`" in options for o in OPTIONS)
    commands = script.cli_markdown()
    names = script._subcommands(build_parser())
    assert {"run", "capture", "nightly", "golden"} <= set(names)
    assert all(f"## `numalign {name}`" in commands for name in names)
    assert "`--calibrate-with MEMBER`" in commands and "`--max-memory DEVICE=SIZE,...`" in commands


def test_a_changed_option_makes_the_reference_stale(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from numalign.session.options import OPTIONS

    script = _script()
    written = tmp_path / "options.md"
    monkeypatch.setattr(script, "expected", lambda: {written: script.options_markdown()})
    assert script.main([]) == 0 and script.main(["--check"]) == 0  # written, then fresh
    changed = [dataclasses.replace(OPTIONS[0], default="cpu"), *OPTIONS[1:]]
    monkeypatch.setattr(script, "expected", lambda: {written: script.options_markdown(changed)})
    assert script.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "stale: run python ci/options_reference.py" in out
    assert "+| `--device DEVICE` | `numalign_device` | string | `cpu` |" in out
