"""Shared setup of the project's own tests."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True, scope="session")
def _worker_setup() -> None:
    """Two cores are shared by the xdist workers: one torch thread each. The modules that
    register torch operator libraries (the compiler's, the functional collectives') are
    imported before any test runs: pytester removes from ``sys.modules`` what a test imported
    while it ran, and importing such a module again registers its library twice (a
    RuntimeError in every later test of the worker that compiles or captures)."""
    import torch
    import torch._dynamo
    import torch.distributed._functional_collectives

    torch.set_num_threads(1)


@pytest.fixture
def on_path(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Subprocesses of a pytester test import this tree's numalign (its src and root first,
    then the test's own folder's plugins and the caller's path)."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(pytester.path), str(ROOT / "src"),
                                                     str(ROOT), os.environ.get("PYTHONPATH")]))
    )  # fmt: skip
