"""Shared setup of the project's own tests."""

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    """Two cores are shared by the xdist workers: one torch thread each."""
    import torch

    torch.set_num_threads(1)
