"""Shared setup of the project's own tests."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    """Two cores are shared by the xdist workers: one torch thread each."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def on_path(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Subprocesses of a pytester test import this tree's numalign (its src and root first,
    then the test's own folder's plugins and the caller's path)."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(pytester.path), str(ROOT / "src"),
                                                     str(ROOT), os.environ.get("PYTHONPATH")]))
    )  # fmt: skip
