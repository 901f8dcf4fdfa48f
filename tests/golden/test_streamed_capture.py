"""Streamed capture (``numalign capture --stream``, ``golden.stream``): the reference streamed
unit by unit from the checkpoint's safetensors writes the set an unstreamed capture writes,
bit for bit (tensors, points, decode, calibration over in-process and subprocess members);
the automatic choice streams where the weights would not fit in the memory available and
says so; a streamed reference holds no real parameter once the capture ends."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from numalign.cli import main
from numalign.golden import GoldenSet
from numalign.golden import capture as capture_module
from numalign.golden import loading as loading_module
from numalign.golden.capture import capture
from numalign.golden.capture_spec import CaptureSpec
from numalign.golden.loading import STREAM_SHARE, checkpoint_bytes, stream_choice
from numalign.golden.reference import Placement
from numalign.replay.ensemble import Member, capture_calibrated

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "golden" / "models"
LLAMA = MODELS / "tiny-llama"
#: A dense model and an MoE whose experts transformers fuses from per-expert tensors.
STREAMED_MODELS = ["tiny-llama", "tiny-qwen3-moe"]
#: Where the automatic choice streams: a quarter of the weights' bytes, far below what
#: ``STREAM_SHARE`` of the memory would hold; where it does not: a thousand times them.
SMALL_MEMORY_SHARE = 0.25
LARGE_MEMORY_SHARE = 1000.0


def _same_set(streamed: GoldenSet, plain: GoldenSet) -> None:
    """Every tensor bitwise, and the manifest (points, requests, decode, shards' sha256,
    calibration) the same, but for when it was captured."""
    assert streamed.manifest.tensors.keys() == plain.manifest.tensors.keys()
    for key in plain.manifest.tensors:
        assert torch.equal(streamed.tensor(key), plain.tensor(key)), key
    got, want = streamed.manifest.to_json(), plain.manifest.to_json()
    got.pop("created"), want.pop("created")
    assert got == want


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, bool]]:
    """Each reference a capture loads, with whether it streams (the capture's own loader,
    watched)."""
    models: list[tuple[Any, bool]] = []
    load = capture_module.load_reference

    def watched(*args: Any, stream: bool = False, **kwargs: Any) -> Any:
        model = load(*args, stream=stream, **kwargs)
        models.append((model, stream))
        return model

    monkeypatch.setattr(capture_module, "load_reference", watched)
    return models


@pytest.mark.parametrize("name", STREAMED_MODELS)
def test_a_streamed_capture_is_the_unstreamed_capture_bit_for_bit(
    tmp_path: Path, name: str, loaded: list[tuple[Any, bool]]
) -> None:
    model_dir = MODELS / name
    plain = capture(model_dir, tmp_path / "plain", CaptureSpec(progress=False, stream=False))
    streamed = capture(model_dir, tmp_path / "streamed", CaptureSpec(progress=False, stream=True))
    assert [s for _, s in loaded] == [False, True]
    assert streamed.manifest.decode and streamed.manifest.continuation  # it decoded
    assert any(p.name.endswith("norm") for p in streamed.manifest.points)
    _same_set(streamed, plain)
    # once the capture ends, the streamed reference holds no real parameter
    model = loaded[1][0]
    assert model.numalign_streamer.resident() == []
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.numalign_streamer.peak_bytes > 0  # it did read weights


def test_every_calibration_member_streams_with_the_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from numalign.replay import calibrate

    in_process: list[bool] = []
    load = calibrate.load_reference

    def watched(*args: Any, stream: bool = False, **kwargs: Any) -> Any:
        in_process.append(stream)
        return load(*args, stream=stream, **kwargs)

    monkeypatch.setattr(calibrate, "load_reference", watched)
    # the reference in process and a member in a subprocess (an environment variable makes
    # it one), calibrating bfloat16: the same calibration streamed and not
    members = [Member("reference"), Member("sub", {"NUMALIGN_STREAM_TEST": "1"}, threads=1)]
    spec = CaptureSpec(progress=False, long=0, far=0, decode_steps=2, continuation=2)
    options: dict[str, Any] = dict(calibrate=["bfloat16"], members=members)
    plain = capture_calibrated(LLAMA, tmp_path / "plain", replace(spec, stream=False), **options)
    streamed = capture_calibrated(LLAMA, tmp_path / "streamed", replace(spec, stream=True),
                                  **options)  # fmt: skip
    assert in_process == [False, True]
    assert len(streamed.manifest.ensemble["bfloat16"]) == len(members)
    _same_set(streamed, plain)


def test_a_member_in_a_subprocess_is_told_to_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    from numalign.replay import ensemble

    commands: list[list[str]] = []

    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        Path(command[command.index("--out") + 1]).write_text('{"tables": {}}')
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(ensemble.subprocess, "run", run)
    member = Member("sub", {"NUMALIGN_STREAM_TEST": "1"})
    for stream in (True, False):
        ensemble._run_in_subprocess(member, tmp_path, ["bfloat16"], False, stream)
    assert ["--stream" in c for c in commands] == [True, False]


def test_the_member_command_line_streams(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from numalign.replay import ensemble_member

    asked: list[bool] = []

    def calibrate_member(*args: Any, stream: bool = False, **kwargs: Any) -> Any:
        asked.append(stream)
        return ensemble_member.MemberResult()

    monkeypatch.setattr(ensemble_member, "calibrate_member", calibrate_member)
    out = str(tmp_path / "calibration.json")
    ensemble_member.main(["set", "--dtypes", "bfloat16", "--out", out, "--stream"])
    ensemble_member.main(["set", "--dtypes", "bfloat16", "--out", out])
    assert asked == [True, False]


def _memory(monkeypatch: pytest.MonkeyPatch, share: float) -> int:
    """The memory available made ``share`` of tiny-llama's float32 weights."""
    weights = checkpoint_bytes(LLAMA, 4)
    assert weights is not None and weights > 0
    available = int(weights * share)
    monkeypatch.setattr(loading_module, "available_memory", lambda: available)
    return weights


def test_the_automatic_choice_streams_where_memory_is_short_and_says_so(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    loaded: list[tuple[Any, bool]],
) -> None:
    weights = _memory(monkeypatch, SMALL_MEMORY_SHARE)
    code = main(["capture", str(LLAMA), "--out", str(tmp_path / "set"), "--calibrate", "",
                 "--long", "0", "--far", "0"])  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if "streaming its weights" in ln)
    assert line.startswith(f"numalign capture: the float32 reference needs {weights / 1e9:.1f} GB")
    assert "(--stream;" in line and "--no-stream" in line
    # the checkpoint was hashed beside the streamed reads, and it says how fast
    assert any(ln.startswith("numalign capture: ") and "of checkpoint hashed in" in ln
               for ln in err.splitlines())  # fmt: skip
    assert [s for _, s in loaded] == [True]
    assert loaded[0][0].numalign_streamer.resident() == []


@pytest.mark.parametrize(
    ("share", "flags"),
    [(LARGE_MEMORY_SHARE, []), (SMALL_MEMORY_SHARE, ["--no-stream"])],
    ids=["fits", "no-stream"],
)
def test_a_reference_that_fits_or_no_stream_loads_whole(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    loaded: list[tuple[Any, bool]],
    share: float,
    flags: list[str],
) -> None:
    _memory(monkeypatch, share)
    code = main(["capture", str(LLAMA), "--out", str(tmp_path / "set"), "--calibrate", "",
                 "--long", "0", "--far", "0", *flags])  # fmt: skip
    assert code == 0
    assert "streaming" not in capsys.readouterr().err
    assert [s for _, s in loaded] == [False]


def test_the_choice_rules(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # the weights just within the share (1% of the memory to spare: rounding): they fit
    weights = _memory(monkeypatch, 1 / STREAM_SHARE + 0.01)
    assert stream_choice(LLAMA, "float32", None) == (False, None)
    # float64 doubles the weights (8 bytes an element, not 4): past the share
    assert stream_choice(LLAMA, "float64", None)[0]
    assert stream_choice(LLAMA, "float64", False) == (False, None)
    assert stream_choice(LLAMA, "float32", True) == (True, None)
    assert checkpoint_bytes(LLAMA, 8) == 2 * weights
    # big-model placement is the user's choice: never streamed automatically, and not both
    assert stream_choice(LLAMA, "float64", None, placement=Placement()) == (False, None)
    with pytest.raises(ValueError, match="--stream and --device-map are two ways"):
        stream_choice(LLAMA, "float32", True, placement=Placement())
    # no safetensors: no estimate, never streamed automatically
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert checkpoint_bytes(tmp_path, 4) is None
    assert stream_choice(tmp_path, "float32", None) == (False, None)


def test_stream_with_device_map_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit, match="--stream and --device-map are two ways"):
        main(["capture", str(LLAMA), "--out", str(tmp_path / "set"), "--stream",
              "--device-map", "auto"])  # fmt: skip
    assert not (tmp_path / "set").exists()
