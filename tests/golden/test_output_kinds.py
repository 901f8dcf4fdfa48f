"""An output's kind (tensor, mask, selection, routing) is decided by the capture, stored in the
manifest, and what the judge picks its rule from (``compare.output_kind``); sets of formats
before it are read with the kinds the capture would have stored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from numalign.compare.judge import Judge
from numalign.compare.output_kind import MASK, ROUTING_KIND, SELECTION, TENSOR, kind_of
from numalign.compare.routing import ROUTING
from numalign.golden.capture import capture
from numalign.golden.capture_spec import CaptureSpec
from numalign.golden.manifest import FORMAT, MASK_POINT_TYPE, GoldenSetError
from numalign.golden.mask_points import MaskFunction
from numalign.golden.store import GoldenSet
from numalign.replay.model import hidden_and_depth

ROOT = Path(__file__).resolve().parents[2]
#: A zoo member with every kind a decoder has: masks it builds, routers, tensors.
MODEL = "tiny-mixtral"
ZOO_SET = ROOT / "golden" / "sets" / MODEL
QUICK = CaptureSpec(continuation=0, decode_steps=0, long=0, far=0, probes=False, progress=False)
ROUTER = "model.layers.0.mlp.gate"


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> GoldenSet:
    out = tmp_path_factory.mktemp("kinds") / MODEL
    return capture(ROOT / "golden" / "models" / MODEL, out, QUICK)


def test_the_capture_stores_each_output_s_kind(captured: GoldenSet) -> None:
    data = json.loads((captured.path / "manifest.json").read_text())
    assert data["format"] == FORMAT
    kinds = {p["name"]: p["kinds"] for p in data["points"]}
    assert kinds[ROUTER] == {"0": TENSOR, ROUTING: ROUTING_KIND}
    masks = [p["name"] for p in data["points"] if p["type"] == MASK_POINT_TYPE]
    assert masks and all(kinds[m] == {"0": MASK} for m in masks)
    routers = {p["name"] for p in data["points"] if ROUTING in p["kinds"]}
    assert ROUTER in routers
    others = [kinds[p["name"]] for p in data["points"]
              if p["type"] != MASK_POINT_TYPE and p["name"] not in routers]  # fmt: skip
    assert others and all(set(k.values()) == {TENSOR} for k in others)


def _as_format_3(golden: GoldenSet, folder: Path) -> Path:
    """A copy of ``golden`` whose manifest is written as format 3 wrote it: no kinds."""
    shutil.copytree(golden.path, folder)
    data = json.loads((folder / "manifest.json").read_text())
    data["format"] = "numalign.golden/3"
    for point in data["points"]:
        del point["kinds"]
    (folder / "manifest.json").write_text(json.dumps(data, indent=1))
    return folder


def test_an_older_set_reads_the_kinds_the_capture_stores(
    captured: GoldenSet, tmp_path: Path
) -> None:
    """A format 3 set (no kinds stored) reads the kinds a capture stores, point by point;
    ``upgrade`` stores them, and the zoo's sets were upgraded so (their kinds the same)."""
    older = GoldenSet.open(_as_format_3(captured, tmp_path / "older"))
    fresh = {p.name: p.kinds for p in captured.points}
    assert {p.name: p.kinds for p in older.points} == fresh
    assert older.upgrade() == "numalign.golden/3"
    stored = json.loads((older.path / "manifest.json").read_text())
    assert stored["format"] == FORMAT
    assert {p["name"]: p["kinds"] for p in stored["points"]} == fresh
    assert older.upgrade() is None  # already current
    zoo = GoldenSet.open(ZOO_SET)
    assert {p.name: p.kinds for p in zoo.points if p.name in fresh} == fresh


def test_a_set_older_than_format_3_is_not_upgraded(captured: GoldenSet, tmp_path: Path) -> None:
    folder = _as_format_3(captured, tmp_path / "older")
    data = json.loads((folder / "manifest.json").read_text())
    data["format"] = "numalign.golden/2"
    (folder / "manifest.json").write_text(json.dumps(data, indent=1))
    with pytest.raises(GoldenSetError, match=r"format numalign\.golden/2 cannot be upgraded"):
        GoldenSet.open(folder).upgrade()


def test_the_mask_point_type_is_the_mask_function_s() -> None:
    assert MaskFunction.__name__ == MASK_POINT_TYPE


@pytest.mark.parametrize(
    ("path", "dtype", "mask_point", "kind"),
    [
        ("0", "float32", False, TENSOR),
        ("0", "bfloat16", False, TENSOR),
        (ROUTING, "float32", False, ROUTING_KIND),
        ("0", "bool", False, MASK),
        ("0", "float32", True, MASK),  # an additive mask the model builds is still a mask
        ("2", "int64", False, SELECTION),
        ("1", "int32", False, SELECTION),
    ],
)
def test_kind_of(path: str, dtype: str, mask_point: bool, kind: str) -> None:
    assert kind_of(path, dtype, mask_point=mask_point) == kind


def test_the_judge_takes_the_stored_kind() -> None:
    """A router's routing is judged as routing because the set says it is one: a token whose
    weights move to other experts is counted as a flip (allowed: a near tie may flip), where
    the same tensors judged as plain values fail."""
    from numalign.compare.model_verdict import compare_point

    zoo = GoldenSet.open(ZOO_SET)
    judge = Judge.of_set(zoo, "bfloat16", "isolated", hidden_and_depth(config=_config()))
    request = zoo.requests[0].name
    expected = zoo.tensor(zoo.point(ROUTER).calls[request][0].outputs[ROUTING]).bfloat16()
    flipped = expected.clone()
    flipped[-1] = flipped[-1].roll(1, -1)  # the last token's weights on other experts
    routed = judge.compare(ROUTER, ROUTING, flipped, expected.double())
    # counted as one flip among the flips a near tie may make (8 here: the ensemble's)
    assert routed.passed and routed.budget["flips"] == 1, routed.message()
    as_values = compare_point(flipped, expected.double(), ROUTING, judge.control(ROUTER, ROUTING),
                              None, TENSOR)  # fmt: skip
    assert not as_values.passed


def test_an_output_the_set_lacks_names_the_point_s_outputs(captured: GoldenSet) -> None:
    with pytest.raises(GoldenSetError, match=r"has no output 'residual' \(it has 0\)"):
        captured.output_kind("model.layers.0.input_layernorm", "residual")


def test_an_unknown_kind_in_a_manifest_is_an_error(captured: GoldenSet, tmp_path: Path) -> None:
    data = json.loads((captured.path / "manifest.json").read_text())
    data["points"][0]["kinds"] = {"0": "tensors"}
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(data))
    from numalign.golden.manifest import Manifest

    with pytest.raises(ValueError, match="unknown output kind 'tensors'"):
        Manifest.from_json(data, path)


def _config() -> object:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(ROOT / "golden" / "models" / MODEL)


def test_a_selection_is_judged_in_any_order() -> None:
    """The kind decides, not the dtype: indices stored as a selection pass in another order."""
    from numalign.compare.calibration import Control
    from numalign.compare.metrics import ControlErrors
    from numalign.compare.model_verdict import compare_point

    control = Control(ControlErrors(max_abs=0.0, rel_l2=0.0), reduction=1)
    top = torch.tensor([[3, 0, 2, 1]])
    assert compare_point(top.flip(-1), top, "indexer.1", control, None, SELECTION).passed
    with pytest.raises(ValueError, match="no rule for output kind 'indices'"):
        compare_point(top, top, "indexer.1", control, None, "indices")
