"""The on-disk cache of float64 truths (numalign.ops.truths): bit-identical hits, misses on any
change of what decides the values, damaged entries recomputed, and the plugin's option."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from numalign.ops import check as opcheck
from numalign.ops.registry import OPERATORS, candidates, load_catalogue
from numalign.ops.truths import (
    TruthCache,
    active_truth_cache,
    restore_truth_cache,
    use_truth_cache,
)

load_catalogue()
RMS = OPERATORS["rms_norm"]
CASE = next(c for c in RMS.cases if c.name == "prime-7x1031")


def _same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    return type(a) is type(b) and a == b


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[TruthCache]:
    """The truth cache on in a fresh folder, with the per-worker memory emptied."""
    previous = use_truth_cache(tmp_path / "truths")
    opcheck._truths.clear()
    active = active_truth_cache()
    assert active is not None
    yield active
    opcheck._truths.clear()
    restore_truth_cache(previous)


def _fresh(op: Any = RMS, case: Any = CASE, dtype: torch.dtype = torch.bfloat16) -> Any:
    """inputs_and_truth with nothing in memory (it goes to the disk cache, if on)."""
    opcheck._truths.clear()
    return opcheck.inputs_and_truth(op, case, dtype)


def test_a_cached_truth_is_bit_identical_to_a_recomputed_one(cache: TruthCache) -> None:
    _fresh()
    assert cache.stats["written"] == 1
    cached_inputs, cached_truth = _fresh()
    assert cache.stats["hit"] == 1
    previous = use_truth_cache(None)
    try:
        recomputed_inputs, recomputed_truth = _fresh()
    finally:
        restore_truth_cache(previous)
    assert list(cached_truth) == list(recomputed_truth) == ["out"]
    assert list(cached_inputs) == list(recomputed_inputs)
    for name in recomputed_truth:
        assert _same_bits(cached_truth[name], recomputed_truth[name])
    for name in recomputed_inputs:
        assert _same_bits(cached_inputs[name], recomputed_inputs[name]), name
    assert cached_truth["out"].dtype == torch.float64


def test_the_suite_judges_the_same_with_a_cached_truth(cache: TruthCache) -> None:
    cand = next(iter(candidates("rms_norm").values()))
    first = opcheck.check_operator(RMS, cand, CASE, torch.float16, torch.device("cpu"))
    opcheck._truths.clear()
    second = opcheck.check_operator(RMS, cand, CASE, torch.float16, torch.device("cpu"))
    assert cache.stats["hit"] == 1
    assert [r.metrics for r in first] == [r.metrics for r in second]


def _other_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """The same maths, another source: a changed reference."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (offset + weight.to(xf.dtype))).to(x.dtype)


@pytest.mark.parametrize(
    "change",
    ["reference", "inputs builder", "case name", "case parameters", "regime", "dtype", "torch"],
)
def test_any_change_of_what_decides_the_truth_misses(
    cache: TruthCache, change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fresh()
    op, case, dtype = RMS, CASE, torch.bfloat16
    if change == "reference":
        op = dataclasses.replace(RMS, reference=_other_reference)
    elif change == "inputs builder":
        op = dataclasses.replace(RMS, make_inputs=lambda c, g: RMS.make_inputs(c, g))
    elif change == "case name":
        case = dataclasses.replace(CASE, name="prime-7x1031-b")
    elif change == "case parameters":
        case = dataclasses.replace(CASE, params={**CASE.params, "tokens": 8})
    elif change == "regime":
        case = dataclasses.replace(CASE, regime="small")
    elif change == "dtype":
        dtype = torch.float16
    else:
        monkeypatch.setattr(torch, "__version__", "99.0.0+other")
    assert cache.load(op, case, dtype) is None
    assert cache.stats["hit"] == 0
    monkeypatch.undo()
    assert cache.load(RMS, CASE, torch.bfloat16) is not None  # the original still hits


def test_a_reference_without_readable_source_is_not_cached(cache: TruthCache) -> None:
    namespace: dict[str, Any] = {}
    exec("def reference(x, weight, eps, offset=0.0):\n    return x * weight", namespace)
    op = dataclasses.replace(RMS, reference=namespace["reference"])
    assert cache.key(op, CASE, torch.float32) is None
    _fresh(op, CASE, torch.float32)
    assert cache.stats["written"] == 0


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "empty", "not safetensors"])
def test_a_damaged_entry_is_recomputed_not_trusted(cache: TruthCache, damage: str) -> None:
    _, truth = _fresh()
    key = cache.key(RMS, CASE, torch.bfloat16)
    assert key is not None
    path = cache.path(key)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "flipped byte":
        data[-3] ^= 0x40  # in the last tensor's values: the header still parses
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"\x80\x04not a safetensors file")
    path.write_bytes(bytes(data))
    assert cache.load(RMS, CASE, torch.bfloat16) is None
    assert cache.stats["rejected"] == 1
    _, again = _fresh()  # recomputed, and written back whole
    assert _same_bits(again["out"], truth["out"])
    assert cache.load(RMS, CASE, torch.bfloat16) is not None


def test_writes_are_atomic(cache: TruthCache, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    _fresh()  # the failed write does not fail the check
    assert cache.stats["written"] == 0
    assert not [p for p in cache.folder.rglob("*") if p.is_file() and p.name != ".gitignore"]
    monkeypatch.undo()
    _fresh()
    files = [p.name for p in cache.folder.rglob("*") if p.is_file()]
    assert len([f for f in files if f.endswith(".safetensors")]) == 1
    assert not [f for f in files if f.endswith(".tmp")]
    assert (cache.folder / ".gitignore").read_text().splitlines()[-1] == "*"


SHOWS_CACHE = """
from numalign.ops.truths import active_truth_cache

def test_cache():
    cache = active_truth_cache()
    print("TRUTH-CACHE", cache.folder if cache is not None else None)
"""


def _shown(result: pytest.RunResult) -> str:
    result.assert_outcomes(passed=1)
    line = next(line for line in result.outlines if "TRUTH-CACHE" in line)
    return line.split("TRUTH-CACHE ", 1)[1].split(" ")[0].rstrip(".")


@pytest.mark.parametrize(
    ("args", "ini", "env", "expected"),
    [
        ((), "", None, "{root}/.numalign-cache/truths"),
        (("--truth-cache", "off"), "", None, "None"),
        (("--truth-cache", "elsewhere"), "", None, "{root}/elsewhere"),
        ((), "numalign_truth_cache = off\n", None, "None"),
        ((), "numalign_truth_cache = from-ini\n", None, "{root}/from-ini"),
        (("--truth-cache", "cli"), "numalign_truth_cache = off\n", None, "{root}/cli"),
        ((), "", "{root}/shared", "{root}/shared/truths"),
    ],
)
def test_the_option_ini_key_and_environment_choose_the_folder(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    ini: str,
    env: str | None,
    expected: str,
) -> None:
    root = str(pytester.path)
    if env is None:
        monkeypatch.delenv("NUMALIGN_CACHE", raising=False)
    else:
        monkeypatch.setenv("NUMALIGN_CACHE", env.format(root=root))
    pytester.makeini(f"[pytest]\n{ini}")
    pytester.makepyfile(SHOWS_CACHE)
    before = active_truth_cache()
    result = pytester.runpytest("-s", *args)
    assert _shown(result) == expected.format(root=root)
    assert active_truth_cache() is before  # an in-process run leaves this process's as it was


def test_the_suite_fills_the_cache_and_off_leaves_none(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch
        from numalign.ops.check import check_operator, _truths
        from numalign.ops.registry import OPERATORS, candidates, load_catalogue

        def test_one(numalign_device):
            load_catalogue()
            op = OPERATORS["rms_norm"]
            case = next(c for c in op.cases if c.name == "tiny-3x8")
            cand = next(iter(candidates("rms_norm").values()))
            _truths.clear()
            assert all(r.passed for r in check_operator(op, cand, case, torch.float16,
                                                        numalign_device))
        """
    )
    # in subprocesses: torch registers operator libraries once per process
    pytester.runpytest_subprocess("--truth-cache", "off").assert_outcomes(passed=1)
    assert not (pytester.path / ".numalign-cache").exists()
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    entries = list((pytester.path / ".numalign-cache" / "truths").rglob("*.safetensors"))
    assert len(entries) == 1 and "tiny-3x8-torch.float16" in entries[0].name


def _forge(cache: TruthCache, scale: float, secret: bytes | None) -> None:
    """Rewrites the entry with its truth scaled and a checksum computed as the old scheme
    (sha256, anyone can) or with ``secret``: what a writer to a shared cache can do."""
    import hashlib

    from safetensors.torch import load, save_file

    from numalign.ops import truths

    key = cache.key(RMS, CASE, torch.bfloat16)
    assert key is not None
    path = cache.path(key)
    data = path.read_bytes()
    metadata = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    tensors = load(data)
    tensors["truth.out"] = tensors["truth.out"] * scale
    if secret is None:
        digest = hashlib.sha256()
        for name in sorted(tensors):
            t = tensors[name]
            digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            digest.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().data)
        metadata["checksum"] = digest.hexdigest()
    else:
        metadata["checksum"] = truths._checksum(tensors, metadata, secret)
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize("forger", ["plain sha256", "another user's secret"])
def test_a_forged_entry_is_not_trusted(
    cache: TruthCache, forger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27, item 9: the checksum was computed by whoever wrote the entry, so a wrong
    truth with a right checksum made a known-wrong kernel pass."""
    _, truth = _fresh()
    _forge(cache, 1.05, None if forger == "plain sha256" else b"not this user's secret")
    assert cache.load(RMS, CASE, torch.bfloat16) is None
    assert cache.stats["rejected"] == 1
    _, again = _fresh()  # recomputed from the reference, and written back signed
    assert _same_bits(again["out"], truth["out"])


def test_a_shared_secret_lets_several_writers_share_a_cache(
    cache: TruthCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = cache.secret  # this user's, read before the shared one is set
    monkeypatch.setenv("NUMALIGN_CACHE_SECRET", "ci-secret")
    shared = TruthCache(cache.folder)
    assert shared.secret == b"ci-secret" != own
    _fresh()  # written by this process, signed with its own secret
    assert shared.load(RMS, CASE, torch.bfloat16) is None  # not the shared secret's
    _forge(cache, 1.0, b"ci-secret")  # another machine with the shared secret wrote it
    assert shared.load(RMS, CASE, torch.bfloat16) is not None
    assert cache.load(RMS, CASE, torch.bfloat16) is None  # not this user's own secret


class _Account:
    """The password database's entry of this user, as ``pwd.getpwuid`` gives it."""

    def __init__(self, home: str) -> None:
        self.pw_dir = home


@pytest.fixture
def no_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """HOME empty (Python's ``Path.home()`` is then ``/``), no XDG_CACHE_HOME, no shared
    secret; every mkstemp refused outside the test's folders, so a secret meant for ``/`` is
    never written there even where the test fails."""
    import tempfile

    monkeypatch.setenv("HOME", "")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("NUMALIGN_CACHE_SECRET", raising=False)
    real_mkdir, real_mkstemp = Path.mkdir, tempfile.mkstemp

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        assert str(self.resolve()).startswith(tempfile.gettempdir()), f"mkdir {self}"
        real_mkdir(self, *args, **kwargs)

    def mkstemp(*args: Any, dir: Any = None, **kwargs: Any) -> Any:
        assert str(Path(dir).resolve()).startswith(tempfile.gettempdir()), f"mkstemp in {dir}"
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


@pytest.mark.usefixtures("no_home")
def test_with_home_empty_the_secret_goes_to_the_user_s_own_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 42, item 14: with HOME empty the secret was written to /.cache/numalign."""
    import pwd

    from numalign.ops.truths import cache_secret

    monkeypatch.setattr(pwd, "getpwuid", lambda uid: _Account(str(tmp_path / "home")))
    secret = cache_secret()
    made = tmp_path / "home" / ".cache" / "numalign" / "truth-secret"
    # 32 random bytes as hex: what cache_secret makes
    assert made.read_bytes() == secret and len(secret) == 64
    assert (made.stat().st_mode & 0o777) == 0o600  # this user's alone


@pytest.mark.usefixtures("no_home")
@pytest.mark.parametrize("account", ["/", "", "relative/home"])
def test_with_no_home_at_all_the_cache_refuses_saying_what_to_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, account: str
) -> None:
    import pwd

    from numalign.ops.truths import CacheSecretError, cache_secret

    monkeypatch.setattr(pwd, "getpwuid", lambda uid: _Account(account))
    message = (
        "the truth cache's secret has no home: HOME is empty and this user's home "
        f"directory ({account!r}) is not a folder to write to; set NUMALIGN_CACHE_SECRET "
        "(a cache shared by machines), XDG_CACHE_HOME or HOME, or turn the cache off with "
        "--truth-cache off"
    )
    with pytest.raises(CacheSecretError) as caught:
        cache_secret()
    assert str(caught.value) == message
    with pytest.raises(CacheSecretError):  # a session that turns it on refuses at once
        use_truth_cache(tmp_path / "truths")
    # a relative XDG_CACHE_HOME is not one (the XDG rule: ignored), an absolute one is
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    with pytest.raises(CacheSecretError):
        cache_secret()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_secret() == (tmp_path / "xdg" / "numalign" / "truth-secret").read_bytes()


@pytest.mark.usefixtures("no_home")
def test_a_session_with_nowhere_for_the_secret_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pwd

    monkeypatch.setattr(pwd, "getpwuid", lambda uid: _Account("/"))
    monkeypatch.setenv("HOME", "")  # after pytester's own HOME
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*numalign: the truth cache's secret has no home*"])
    assert pytester.runpytest("--truth-cache", "off").ret == pytest.ExitCode.OK
