"""Fixtures of the golden-store tests: a writable copy of the zoo's tiny-llama."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "golden" / "models" / "tiny-llama"


@pytest.fixture
def model_copy(tmp_path: Path) -> Path:
    """tiny-llama's model folder copied under ``tmp_path`` (tests change or break it)."""
    folder = tmp_path / "models" / "tiny-llama"
    shutil.copytree(LLAMA, folder)
    return folder
