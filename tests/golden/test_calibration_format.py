"""The calibration is typed (``compare.calibration``) and read and written in
``golden.manifest`` alone: every zoo set's manifest read and written again is the same bytes,
its statistics typed, and a manifest with a malformed calibration is an error naming the
file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from numalign.compare.calibration import Calibration, ControlStats
from numalign.golden.manifest import (
    GoldenSetError,
    Manifest,
    calibration_from_json,
    calibration_to_json,
)

SETS = Path(__file__).resolve().parents[2] / "golden" / "sets"
MANIFESTS = sorted(SETS.glob("*/manifest.json"))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.parent.name)
def test_a_zoo_manifest_reads_and_writes_back_byte_for_byte(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    manifest = Manifest.from_json(json.loads(text), path)
    assert manifest.calibration, "the zoo's sets are calibrated"
    for calibration in manifest.calibration.values():
        assert isinstance(calibration, Calibration)
        for _, _, _, stats in calibration.entries():
            assert isinstance(stats, ControlStats) and not stats.extra
    # write(read(x)) == x, as store.write_manifest writes it
    assert json.dumps(manifest.to_json(), indent=1, allow_nan=False) == text


def test_statistics_keep_their_order_and_unknown_ones() -> None:
    data = {"p": {"0": {"isolated": {"rel_l2": 0.5, "future_stat": 3.0, "max_abs": None}}}}
    calibration = calibration_from_json(data)
    stats = calibration.stats("p", "0", "isolated")
    assert stats is not None and stats.rel_l2 == 0.5 and stats.max_abs is None
    assert stats.extra == {"future_stat": 3.0}
    assert list(calibration_to_json(calibration)["p"]["0"]["isolated"]) == [
        "rel_l2", "future_stat", "max_abs",
    ]  # fmt: skip
    assert calibration.stats("p", "0", "decode") is None


def test_a_malformed_calibration_names_the_file(tmp_path: Path) -> None:
    data = json.loads(MANIFESTS[0].read_text(encoding="utf-8"))
    data["calibration"] = {"bfloat16": {"p": {"0": ["not", "an", "object"]}}}
    with pytest.raises(GoldenSetError, match=r"manifest\.json: a field does not have the format"):
        Manifest.from_json(data, tmp_path / "manifest.json")
