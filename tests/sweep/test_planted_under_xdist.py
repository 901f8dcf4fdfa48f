"""The sweep's planted step runs its swap as users run one, under xdist (``-n 2``): a swap
whose failure only xdist's workers show (a usage error that aborted ``pytest -n 2`` with an
INTERNALERROR on Cohere 2, while the sweep's plain session never met it) is met by the sweep
too, and the planted norm is still caught at a norm."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from numalign.sweep import one
from numalign.sweep.table import SweepRow

ROOT = Path(__file__).resolve().parents[2]


def test_the_planted_step_replays_its_swap_under_xdist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[tuple[tuple[str, ...], int, str]] = []
    real = one._pytest

    def spy(suites: Path, golden: Path, reports: Path, *args: str) -> tuple[int, str]:
        code, output = real(suites, golden, reports, *args)
        runs.append((args, code, output))
        return code, output

    monkeypatch.setattr(one, "_pytest", spy)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    row = SweepRow("llama", "yes", "ok", "clean")
    golden, model_dir = ROOT / "golden" / "sets" / "tiny-llama", ROOT / "golden" / "models"
    one.planted(row, ROOT / "suites", golden, tmp_path / "planted", model_dir / "tiny-llama")
    [(args, code, output)] = runs
    assert code == 1, output[-3000:]  # the planted norm fails its test, as planted to
    assert "bringing up nodes" in output, output[-3000:]  # xdist's controller ran the workers
    assert ("-n", str(one.PLANTED_WORKERS)) in itertools.pairwise(args)
    assert row.planted == "model.layers.0.input_layernorm (norm)", row.planted
