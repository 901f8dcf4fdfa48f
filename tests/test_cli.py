"""The numalign command line."""

import subprocess
import sys

import numalign
from numalign.cli import main


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "numalign.cli", *args], capture_output=True, text=True
    )


def test_version() -> None:
    out = run("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"numalign {numalign.__version__}"


def test_console_script_is_installed() -> None:
    out = subprocess.run(["numalign", "--version"], capture_output=True, text=True)
    assert out.stdout.strip() == f"numalign {numalign.__version__}"


def test_help_without_a_command(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main([]) == 0
    assert "usage: numalign" in capsys.readouterr().out


def test_unknown_command_is_an_error() -> None:
    out = run("frobnicate")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr
