"""A golden set's power per point (``replay.set_power``, issue 43): what a pass at each point
would catch is figured by the one judge on the truth rounded to the dtype, equals what a
real layer replay of that candidate reports, means what it says (a planted scale twice the
figure fails, half of it passes), survives the manifest (infinity included), and is
(re)computed and shown by ``numalign golden power`` and ``golden show``."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from numalign.cli import main
from numalign.compare.calibration import control_for
from numalign.compare.model_verdict import compare_point, label
from numalign.compare.pooled import POOLED
from numalign.golden import GoldenSet, GoldenSetError
from numalign.golden.manifest import Manifest
from numalign.golden.reference import load_model
from numalign.replay.layer import kept_positions, request_mask
from numalign.replay.model import hidden_and_depth, replay_layer
from numalign.replay.set_power import model_config, set_power

ROOT = Path(__file__).resolve().parents[2]
SET = ROOT / "golden" / "sets" / "tiny-llama"
#: A point with one float output and a call in each of the set's requests, so that the
#: set's figure is a largest over several calls.
POINT = "model.layers.0.mlp"
#: The causal mask the model builds: boolean, judged exactly, so without power.
MASK = "model.create_causal_mask"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def golden() -> GoldenSet:
    return GoldenSet.open(SET)


@pytest.fixture(scope="module")
def power(golden: GoldenSet) -> Any:
    return set_power(golden)


def _entries(power: Any, dtype: str) -> dict[tuple[str, str, str], dict[str, float]]:
    return {(point, path, mode): figures
            for point, outputs in power[dtype].items()
            for path, modes in outputs.items() for mode, figures in modes.items()}  # fmt: skip


def test_float_points_have_finite_positive_figures_far_smaller_in_float32(
    golden: GoldenSet, power: Any
) -> None:
    assert set(power) == set(golden.manifest.calibration)
    bf16, f32 = _entries(power, "bfloat16"), _entries(power, "float32")
    assert (POINT, "0", "isolated") in bf16 and (POINT, "0", "accumulated") in bf16
    assert not any(point == MASK for point, _, _ in bf16)  # a mask has no size to catch
    for entries in (bf16, f32):
        for key, figures in entries.items():
            assert 0 < figures["scale"] < math.inf and 0 < figures["bias"] < math.inf, key
    shared = set(bf16) & set(f32)
    assert len(shared) > 20, "most point outputs are calibrated in both"  # 31 in tiny-llama
    for key in shared:
        # their roundings differ by 2**16 (2**-8 against 2**-24); float32's budgets are
        # wider than one rounding (reductions reordered: sqrt(hidden) roundings, the
        # borrowed float16 control), so a factor 100 leaves room and is still "far"
        assert f32[key]["scale"] * 100 < bf16[key]["scale"], key


def test_the_zoo_stores_the_power_computed_now(golden: GoldenSet, power: Any) -> None:
    stored = golden.manifest.power
    assert set(stored) == set(power)
    for dtype in power:
        now, then = _entries(power, dtype), _entries(stored, dtype)
        assert set(now) == set(then), dtype
        for key, figures in now.items():
            # a float64 sum ordered by another machine's kernels moves a figure by ~1e-12;
            # a stale zoo (a changed rule or calibration) by far more than 1e-6
            assert figures == pytest.approx(then[key], rel=1e-6), (dtype, key)
    assert (
        golden.power("bfloat16", POINT, "0", "isolated")
        == stored["bfloat16"][POINT]["0"]["isolated"]
    )


def _replay_rounded_truth(golden: GoldenSet, dtype: str) -> list[Any]:
    """The layer replay of ``POINT`` in ``dtype`` whose module returns, at each call, the
    golden output of that call rounded to ``dtype``: the set's stand-in candidate, run
    through the real replay (its own results, not the pooled lean's)."""
    model = load_model(golden.model_dir, dtype, attn_implementation="eager",
                       trust_remote_code=False)  # fmt: skip
    point = golden.point(POINT)
    keys = iter([call.outputs["0"] for calls in point.calls.values() for call in calls])
    torch_dtype = getattr(torch, dtype)
    module = model.get_submodule(POINT)
    module.register_forward_hook(lambda m, a, out: golden.tensor(next(keys)).to(torch_dtype))
    results = replay_layer(golden, model, point, dtype, CPU)
    return [r for r in results if r.request != POOLED]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_figure_is_what_a_layer_replay_of_the_rounded_truth_reports(
    golden: GoldenSet, power: Any, dtype: str
) -> None:
    results = _replay_rounded_truth(golden, dtype)
    assert len(results) == sum(len(c) for c in golden.point(POINT).calls.values()) > 1
    assert all(r.result.passed for r in results), [r.result.message() for r in results]
    found = [r.result.detectable for r in results]
    assert all(d is not None for d in found)
    figures = power[dtype][POINT]["0"]["isolated"]
    # the same candidate through the same judge: equal to float precision, the largest over
    # the point's calls
    assert figures["scale"] == pytest.approx(max(d.scale for d in found if d), rel=1e-12)
    assert figures["bias"] == pytest.approx(max(d.bias for d in found if d), rel=1e-12)


def test_a_planted_scale_twice_the_figure_fails_and_half_of_it_passes(
    golden: GoldenSet, power: Any
) -> None:
    dtype, scale = "bfloat16", power["bfloat16"][POINT]["0"]["isolated"]["scale"]
    hidden, depth = hidden_and_depth(config=model_config(golden.model_dir))
    control = control_for(golden, dtype, POINT, "0", "isolated", hidden, depth)
    # the call whose figure is the set's (the least power): there the figure is tight
    tight = []
    for request, calls in golden.point(POINT).calls.items():
        for call in calls:
            truth = kept_positions(golden.tensor(call.outputs["0"]), request_mask(golden, request))
            honest = compare_point(truth.to(torch.bfloat16), truth, label(POINT, "0"), control,
                                   None)  # fmt: skip
            if honest.detectable is not None and honest.detectable.scale == scale:
                tight.append(truth)
    assert tight, "the set's figure is one call's"
    truth = tight[0]

    def planted(factor: float) -> bool:
        candidate = (truth.double() * (1 + factor * scale)).to(torch.bfloat16)
        return compare_point(candidate, truth, label(POINT, "0"), control, None).passed

    # the figure is where the rules start failing, of either sign: twice it is past every
    # element's rounding noise (which only makes a planted error fail sooner), half of it
    # within the budget with the noise on top
    assert not planted(2.0) and not planted(-2.0)
    assert planted(0.5) and planted(-0.5)


def test_power_survives_the_manifest_infinity_included(tmp_path: Path) -> None:
    for kind in ("sets", "models"):  # the set's model path is relative: keep them siblings
        shutil.copytree(ROOT / "golden" / kind / "tiny-llama", tmp_path / kind / "tiny-llama")
    folder = tmp_path / "sets" / "tiny-llama"
    golden = GoldenSet.open(folder)
    figures = {"bfloat16": {POINT: {"0": {"isolated": {"scale": 0.01, "bias": math.inf}}}}}
    golden.write_power(figures)
    text = (folder / "manifest.json").read_text()
    assert '"bias": "Infinity"' in text  # strict JSON: no bare Infinity token
    again = GoldenSet.open(folder)
    assert again.manifest.power == figures
    assert again.power("bfloat16", POINT, "0", "isolated") == {"scale": 0.01, "bias": math.inf}
    assert again.power("bfloat16", POINT, "0", "accumulated") is None
    assert again.power("float16", POINT, "0", "isolated") is None
    # read and written back as it was (``test_calibration_format``'s byte-for-byte rule)
    manifest = Manifest.from_json(json.loads(text), folder / "manifest.json")
    assert json.dumps(manifest.to_json(), indent=1, allow_nan=False) == text
    # a recalibration makes the dtype's figures stale: they go with it
    again.write_calibration("bfloat16", again.calibration("bfloat16"))
    assert GoldenSet.open(folder).manifest.power == {}


def test_a_set_without_power_reads_none_and_a_malformed_one_names_the_file(
    tmp_path: Path,
) -> None:
    data = json.loads((SET / "manifest.json").read_text())
    data.pop("power", None)
    older = Manifest.from_json(data, tmp_path / "manifest.json")
    assert older.power == {} and "power" not in older.to_json()
    data["power"] = {"bfloat16": {POINT: {"0": {"isolated": {"scale": "wide"}}}}}
    with pytest.raises(GoldenSetError, match=r"manifest\.json: a field does not have the format"):
        Manifest.from_json(data, tmp_path / "manifest.json")


def test_golden_power_writes_it_and_golden_show_prints_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for kind in ("sets", "models"):
        shutil.copytree(ROOT / "golden" / kind / "tiny-llama", tmp_path / kind / "tiny-llama")
    folder = tmp_path / "sets" / "tiny-llama"
    manifest = folder / "manifest.json"
    data = json.loads(manifest.read_text())
    stored = data.pop("power")
    manifest.write_text(json.dumps(data, indent=1))  # a set captured before power was stored
    assert main(["golden", "show", str(folder)]) == 0
    assert "power      none stored (numalign golden power SET computes it)" in (
        capsys.readouterr().out
    )
    assert main(["golden", "power", str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{folder}: power of ")
    medians = out.split("; median detectable scale ")[1]
    assert [part.split()[0] for part in medians.split(", ")] == list(stored)
    assert json.loads(manifest.read_text())["power"].keys() == stored.keys()
    assert main(["golden", "show", str(folder)]) == 0
    shown = capsys.readouterr().out.splitlines()
    lines = [line.split() for line in shown if line.startswith("  ") and " scale " in line]
    assert {(words[0], words[1]) for words in lines} == {
        (dtype, mode) for dtype in stored for mode in ("isolated", "accumulated")
    }
    bf16 = next(words for words in lines if words[:2] == ["bfloat16", "isolated"])
    isolated = [f["scale"] for (_, _, mode), f in _entries(stored, "bfloat16").items()
                if mode == "isolated"]  # fmt: skip
    # SCALE MEDIAN / WORST, printed with three significant digits
    assert float(bf16[3]) == pytest.approx(statistics.median(isolated), rel=1e-2)
    assert float(bf16[5]) == pytest.approx(max(isolated), rel=1e-2)
