"""The sweep finds the norms to plant in by the class a checkpoint's config names: Mllama's
causal LM saves a text config (``mllama_text_model``) that no Auto class maps, and the
planted step crashed the type's whole sweep process ("Model type should be one of ...");
a planted step that fails now keeps the row with its message. A model whose norms have no
scale (nanochat's) is not planted, and its cell says why, before any replay runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from numalign.ops.registry import load_catalogue
from numalign.sweep import one
from numalign.sweep.build import build_tiny
from numalign.sweep.table import SweepRow


def test_the_norms_of_a_checkpoint_whose_config_no_auto_class_maps(tmp_path: Path) -> None:
    load_catalogue()
    model_dir = build_tiny("mllama", tmp_path / "models")
    names = one.norm_names(model_dir, "rms_norm")
    assert "model.layers.0.input_layernorm" in names


def test_a_failing_planted_step_keeps_the_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def honest(row: SweepRow, *args: object) -> None:
        row.replay = "clean (1 passed, 0 skipped)"

    def planted(*args: object) -> None:
        raise ValueError("Model type should be one of ...")

    monkeypatch.setattr(one, "honest", honest)
    monkeypatch.setattr(one, "planted", planted)
    monkeypatch.setattr("numalign.replay.ensemble.capture_calibrated", lambda *a, **k: None)
    row = one.sweep_type("llama", tmp_path, tmp_path)
    assert row.capture == "ok" and row.replay.startswith("clean")
    assert row.planted.startswith("crash: ValueError: Model type should be one of")
    assert row.crashes == 1


def test_norms_without_a_scale_are_not_planted_and_the_cell_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_catalogue()
    model_dir = build_tiny("nanochat", tmp_path / "models")
    # the rms_norm adapter stands for nanochat's norms but reads no scale from any of them
    assert one.norm_names(model_dir, "rms_norm")
    assert not one.norm_names(model_dir, "rms_norm", readable=True)

    def no_replay(*args: object) -> None:
        raise AssertionError("a planted replay ran for a model with nothing to plant")

    monkeypatch.setattr(one, "_pytest", no_replay)
    row = SweepRow("nanochat")
    one.planted(row, tmp_path, tmp_path, tmp_path, model_dir)
    assert row.planted == (
        "not planted: its norms (NanoChatRMSNorm) have no scale, which the adapter of "
        "rms_norm reads; a scale-free form is not taught yet"
    )


def test_norms_with_a_scale_are_readable_though_the_adapter_probes_them(tmp_path: Path) -> None:
    # the rms_norm adapter runs each module on a probe input to find its form (w or 1 + w),
    # which a module on the meta device cannot: EXAONE 4's planted step crashed so
    load_catalogue()
    model_dir = build_tiny("exaone4", tmp_path / "models")
    names = one.norm_names(model_dir, "rms_norm", readable=True)
    assert "model.layers.0.self_attn.q_norm" in names and "model.norm" in names
