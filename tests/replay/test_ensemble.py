"""The calibration ensemble: members named by the user, the default members for a CPU's
flags, the merge (worst, spread, count), and a real capture whose calibration runs a member
in a subprocess with another oneDNN instruction set."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from numalign.golden.manifest import FORMAT
from numalign.replay.ensemble import Member, default_members, describe, merge

ROOT = Path(__file__).resolve().parents[2]
#: The flags of an AVX-512 machine with bfloat16 and without AMX (an AMD EPYC's).
EPYC = frozenset({"avx2", "avx512f", "avx512_bf16"})


def test_a_member_is_parsed_from_key_value_pairs() -> None:
    member = Member.parse(
        "onednn=AVX2,aten=default,threads=1,attn=sdpa,dtypes=float32/bfloat16,MY_KERNELS=off"
    )
    assert member.env == {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "default",
        "MY_KERNELS": "off",
    }
    assert (member.threads, member.attn_implementation) == (1, "sdpa")
    assert member.dtypes == ("float32", "bfloat16")
    assert not member.in_process
    assert Member.parse("threads=4").in_process  # no environment: it runs here


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("onednn", "is not key=value"),
        ("threads=0", "is not >= 1"),
        ("colour=blue", "unknown key 'colour'"),
    ],
)
def test_a_bad_member_says_what_to_write(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Member.parse(spec)


def test_default_members_move_every_knob_below_the_machines_own() -> None:
    members = {m.name: m for m in default_members("eager", flags=EPYC, cores=2)}
    assert set(members) == {"reference", "low", "mid"}
    low, mid = members["low"], members["mid"]
    # MKL's generic path: another machine's float32 matrix products (MKL picks its kernel
    # by the CPU, whatever oneDNN and ATen are set to)
    assert low.env == {
        "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE",
    }  # fmt: skip
    # float32 only: ATen's scalar kernels emulate 16-bit arithmetic slowly
    assert (low.threads, low.attn_implementation, low.dtypes) == (1, "sdpa", ("float32",))
    # one oneDNN level below the machine's own (AVX512_CORE_BF16), ATen and MKL at AVX2,
    # every core
    assert mid.env == {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
    }  # fmt: skip
    assert (mid.threads, mid.attn_implementation, mid.dtypes) == (2, "sdpa", None)
    # an AVX2-only machine has no lower oneDNN level: ATen's scalar kernels and MKL's generic
    # path still differ, and mid forces MKL's AVX2 path with threads and attention
    avx2 = {m.name: m for m in default_members("sdpa", flags=frozenset({"avx2"}), cores=4)}
    assert set(avx2) == {"reference", "low", "mid"}
    assert avx2["low"].env == {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
    assert avx2["low"].attn_implementation == "eager"
    assert avx2["mid"].env == {"MKL_CBWR": "AVX2"} and avx2["mid"].threads == 4
    # without AVX2 (another architecture) nothing selects kernels: in process
    bare = {m.name: m for m in default_members("sdpa", flags=frozenset(), cores=4)}
    assert bare["mid"].in_process
    # an accelerator: the other attention, in process
    cuda = default_members("sdpa", device="cuda")
    assert [(m.name, m.in_process, m.attn_implementation) for m in cuda] == [
        ("reference", True, None),
        ("attn=eager", True, "eager"),
    ]
    assert describe(low) == (
        "low: ATEN_CPU_CAPABILITY=default, MKL_CBWR=COMPATIBLE, ONEDNN_MAX_CPU_ISA=AVX2, "
        "threads=1, attn=sdpa, dtypes=float32"
    )


def test_merge_keeps_the_worst_the_spread_and_the_count() -> None:
    def member(max_abs: float, cosine: float, norm: float, zeros: float) -> dict:
        stats = {"max_abs": max_abs, "rel_l2": max_abs / 10, "cosine": cosine,
                 "norm_ratio": norm, "zero_fraction": zeros}  # fmt: skip
        return {"model.layers.0": {"0": {"isolated": stats}}}

    merged = merge([member(1.0, 0.999, 1.002, 0.0), member(3.0, 0.99, 0.995, 0.03)])
    stats = merged["model.layers.0"]["0"]["isolated"]
    assert stats["max_abs"] == 3.0 and stats["cosine"] == 0.99
    assert stats["norm_ratio"] == 0.995  # farthest from 1
    assert stats["zero_fraction"] == 0.03
    assert stats["max_abs_spread"] == pytest.approx(3.0)
    assert stats["members"] == 2.0
    # a point only one member has keeps that member's statistics
    alone = merge([member(1.0, 1.0, 1.0, 0.0), {}])
    assert alone["model.layers.0"]["0"]["isolated"]["members"] == 1.0


def test_a_capture_calibrates_over_a_subprocess_member(tmp_path: Path) -> None:
    from numalign.golden import GoldenSet
    from numalign.golden.capture_spec import CaptureSpec
    from numalign.replay.ensemble import capture_calibrated

    model = tmp_path / "tiny-llama"
    shutil.copytree(ROOT / "golden" / "models" / "tiny-llama", model)
    member = Member.parse("onednn=AVX2,aten=default,threads=1")
    golden = capture_calibrated(
        model, tmp_path / "set", CaptureSpec(decode_steps=1, long=0, progress=False),
        calibrate=("float32", "bfloat16"), members=[Member("reference"), member],
    )  # fmt: skip
    reopened = GoldenSet.open(golden.path)
    data = json.loads((golden.path / "manifest.json").read_text())
    assert data["format"] == FORMAT
    # float32: only the subprocess member (the reference is exact there); bfloat16: both
    assert reopened.manifest.ensemble["float32"] == [describe(member)]
    assert reopened.manifest.ensemble["bfloat16"] == ["reference: as captured", describe(member)]
    stats = reopened.calibrated("bfloat16", "model.layers.1", "0", "accumulated")
    assert stats is not None and stats.members == 2.0 and (stats.max_abs or 0) > 0
    f32 = reopened.calibrated("float32", "model.layers.1", "0", "accumulated")
    # AVX2 kernels round float32 sums in another order: a small error, not zero
    assert f32 is not None and 0 < (f32.rel_l2 or 0) < 1e-5


def test_a_member_running_other_code_than_the_capture_s_is_an_error(tmp_path: Path) -> None:
    """A sweep run from a checkout that a merge changed under it crashed on gpt-sw3 with
    ``KeyError: 'tables'``: the capture's process had loaded numalign before the merge and
    its member subprocess imported it after, writing a result in a shape the capture did not
    read. A member now checks that its numalign is the code the capture loaded (the files'
    fingerprint), and one that is not, here a copy with one line changed, is an error that
    says so instead of a calibration from other code."""
    from numalign.golden.capture_spec import CaptureSpec
    from numalign.replay.ensemble import EnsembleError, capture_calibrated

    changed = tmp_path / "changed"
    shutil.copytree(ROOT / "src" / "numalign", changed / "numalign")
    with (changed / "numalign" / "ops" / "cases.py").open("a", encoding="utf-8") as file:
        file.write("# a commit merged while the capture ran\n")
    model = tmp_path / "tiny-llama"
    shutil.copytree(ROOT / "golden" / "models" / "tiny-llama", model)
    member = Member("changed", env={"PYTHONPATH": str(changed)})
    with pytest.raises(EnsembleError, match="not the code the capture started with") as caught:
        spec = CaptureSpec(decode_steps=0, continuation=0, long=0, far=0, progress=False)
        capture_calibrated(model, tmp_path / "set", spec, calibrate=("float32",),
                           members=[member])  # fmt: skip
    assert str(changed / "numalign") in str(caught.value)  # names the other numalign
    assert "capture again once numalign's code stands still" in str(caught.value)
    assert not (tmp_path / "set").exists()  # no set calibrated by other code


def test_the_reference_dtype_s_lean_range_takes_in_the_exact_reference() -> None:
    # float32 members that reorder sums lean by ~1e-8; the reference replayed exactly leans
    # by 0 and must lie inside the range (it is the most honest implementation there is)
    from numalign.replay.ensemble import with_exact_reference

    calibration = {"p": {"0": {"isolated": {"scale_low": -1.2e-8, "scale_high": -1.1e-8,
                                            "offset_low": 2e-9, "offset_high": 3e-9,
                                            "max_abs": 1e-6}}}}  # fmt: skip
    with_exact_reference(calibration)
    stats = calibration["p"]["0"]["isolated"]
    assert (stats["scale_low"], stats["scale_high"]) == (-1.2e-8, 0.0)
    assert (stats["offset_low"], stats["offset_high"]) == (0.0, 3e-9)
    assert stats["max_abs"] == 1e-6  # errors untouched
