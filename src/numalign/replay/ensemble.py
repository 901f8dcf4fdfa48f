"""The calibration ensemble: the honest members a golden set is calibrated over, and how
their calibrations merge (docs/comparison.md).

One control (the reference in the target dtype on the capture machine) is one sample of
honest error; another machine, another kernel library or another attention implementation
rounds elsewhere and is a second sample the budget never saw. A set is therefore calibrated
over an ensemble of honest members, each the reference in the dtype run another honest way:

- ``reference``: the reference as captured (in this process);
- on the CPU, members in subprocesses whose environment selects other kernels as another
  machine would: oneDNN's instruction sets below the machine's own (``ONEDNN_MAX_CPU_ISA``),
  ATen's vectorized kernels at another width (``ATEN_CPU_CAPABILITY``), one thread and
  several (reductions split otherwise), and the other attention implementation (eager or
  SDPA) where the model has both;
- members the user names (``--calibrate-with``, ``Member.parse``).

Per point, output, mode and statistic the merged calibration keeps the ensemble's worst (the
largest error, the lowest cosine, the norm ratio farthest from 1, the most exact zeros, the
widest range of the error's leans) and,
beside it, the spread of the members (``<stat>_spread``: the worst over the smallest, for
max_abs and rel_l2) and their count (``members``). float32 has no reference member (the
golden set is the reference in float32: its error is zero by construction), so it is
calibrated only where another member runs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from numalign.compare.calibration import merge_statistics
from numalign.core.errors import Crashed
from numalign.golden.capture import capture, resolve_stream
from numalign.golden.capture_spec import CaptureSpec
from numalign.golden.manifest import CalibrationJson, calibration_from_json
from numalign.replay.ensemble_member import (
    CODE_CHANGED,
    MemberResult,
    calibrate_member,
    code_fingerprint,
    member_command,
    member_environment,
)
from numalign.replay.set_power import model_config, power_line, set_power
from numalign.session.option_values import parse_dtypes

if TYPE_CHECKING:
    from numalign.golden.reference import Placement
    from numalign.golden.store import GoldenSet

#: The dtypes a capture calibrates by default.
DEFAULT_CALIBRATION = ("float32", "bfloat16", "float16")

#: oneDNN's instruction-set levels, lowest first, with the CPU flag each needs.
ONEDNN_ISAS = (
    ("AVX2", "avx2"),
    ("AVX512_CORE", "avx512f"),
    ("AVX512_CORE_BF16", "avx512_bf16"),
    ("AVX512_CORE_AMX", "amx_bf16"),
)
#: ATen's CPU capabilities, lowest first, with the CPU flag each needs.
ATEN_CAPABILITIES = (("default", ""), ("avx2", "avx2"), ("avx512", "avx512f"))
#: numalign's code as this process loaded it: a member in a subprocess must run the same, or
#: it exits with ``CODE_CHANGED`` and the capture stops (another numalign's results are in a
#: format this one may misread).
_CODE = code_fingerprint()
#: Member keys that are not environment variables.
_KEYS = ("onednn", "aten", "threads", "attn", "dtypes")
#: Statistics whose spread over the members is kept beside the worst.
SPREAD_STATS = ("max_abs", "rel_l2")


class EnsembleError(Crashed, RuntimeError):
    """A member of the calibration ensemble could not run; the message says which and why."""


@dataclass(frozen=True)
class Member:
    """One honest member: environment variables (set before torch loads, so it runs in a
    subprocess where it has any), a thread count and an attention implementation (None: the
    process's default and the set's own)."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    threads: int | None = None
    attn_implementation: str | None = None
    #: the dtypes it calibrates (None: every dtype asked for)
    dtypes: tuple[str, ...] | None = None

    @property
    def in_process(self) -> bool:
        return not self.env

    @classmethod
    def parse(cls, spec: str) -> Member:
        """A member from ``key=value,...``: ``onednn=AVX2``, ``aten=default``, ``threads=1``,
        ``attn=sdpa``, ``dtypes=float32/bfloat16`` (the dtypes it calibrates; default all), or
        an environment variable in capitals (``MY_KERNELS=off``)."""
        env: dict[str, str] = {}
        threads: int | None = None
        attn: str | None = None
        dtypes: tuple[str, ...] | None = None
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            if not sep or not value:
                raise ValueError(
                    f"--calibrate-with {spec!r}: {part!r} is not key=value; keys: "
                    f"{', '.join(_KEYS)}, or an environment variable in capitals"
                )
            if key == "onednn":
                env["ONEDNN_MAX_CPU_ISA"] = value
            elif key == "aten":
                env["ATEN_CPU_CAPABILITY"] = value
            elif key == "threads":
                if not value.isdigit() or int(value) < 1:
                    raise ValueError(f"--calibrate-with {spec!r}: threads={value} is not >= 1")
                threads = int(value)
            elif key == "attn":
                attn = value
            elif key == "dtypes":
                dtypes = tuple(d for d in value.split("/") if d)
            elif key.isupper():
                env[key] = value
            else:
                raise ValueError(
                    f"--calibrate-with {spec!r}: unknown key {key!r}; keys: {', '.join(_KEYS)}, "
                    "or an environment variable in capitals"
                )
        if not (env or threads or attn):
            raise ValueError(f"--calibrate-with {spec!r}: names no setting")
        return cls(spec, env, threads, attn, dtypes)


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _levels(table: Sequence[tuple[str, str]], flags: frozenset[str]) -> list[str]:
    return [name for name, flag in table if not flag or flag in flags]


def _other_attention(attn: str | None) -> str:
    return "sdpa" if attn in (None, "eager") else "eager"


def default_members(
    attn_implementation: str | None,
    *,
    device: str = "cpu",
    flags: frozenset[str] | None = None,
    cores: int | None = None,
) -> list[Member]:
    """The ensemble a capture calibrates over by default: the reference, and on the CPU two
    members that between them change every knob another machine would (each knob to a value
    the reference does not use), so that two subprocesses cover what a full grid would:

    - ``low``: oneDNN at AVX2, ATen's scalar kernels, MKL's generic code path
      (``MKL_CBWR=COMPATIBLE``), one thread, the other attention; float32 only (ATen's
      scalar kernels emulate 16-bit arithmetic, several times slower than float32);
    - ``mid``: oneDNN one level below the machine's own (where there is one), ATen at AVX2,
      MKL's AVX2 code path (``MKL_CBWR=AVX2``, where the CPU has AVX2), every core, the other
      attention; every dtype (on a CPU without a lower level or AVX2 it runs in process,
      threads and attention only).

    MKL computes torch's float32 matrix products on x86 and picks its kernel by the CPU, not
    by oneDNN's or ATen's settings: only ``MKL_CBWR`` moves it, so a machine whose MKL takes
    another code path than the capture's is covered only by members on the other paths
    (docs/golden-sets.md).

    So float32 has two members besides the reference (which is exact there: the golden set is
    the reference in float32) and the 16-bit dtypes have the reference and ``mid``; what
    they cost: docs/measurements.md (``bench/bench_ensemble.py``). On an
    accelerator the environment does not select kernels: the other attention implementation,
    in process."""
    members = [Member("reference")]
    other = _other_attention(attn_implementation)
    if device != "cpu":
        return [*members, Member(f"attn={other}", attn_implementation=other)]
    flags = cpu_flags() if flags is None else flags
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    isas = _levels(ONEDNN_ISAS, flags)
    atens = _levels(ATEN_CAPABILITIES, flags)
    low_env = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
    if len(isas) > 1:
        low_env["ONEDNN_MAX_CPU_ISA"] = isas[0]
    members.append(Member("low", low_env, threads=1, attn_implementation=other,
                          dtypes=("float32",)))  # fmt: skip
    mid_env: dict[str, str] = {"MKL_CBWR": "AVX2"} if "avx2" in flags else {}
    if len(isas) > 2:
        mid_env["ONEDNN_MAX_CPU_ISA"] = isas[-2]
    if len(atens) > 2:
        mid_env["ATEN_CPU_CAPABILITY"] = "avx2"
    members.append(Member("mid", mid_env, threads=max(2, cores), attn_implementation=other))
    return members


def describe(member: Member) -> str:
    """The member as the manifest lists it: its name and every setting it changes."""
    parts = [f"{k}={v}" for k, v in sorted(member.env.items())]
    if member.threads:
        parts.append(f"threads={member.threads}")
    if member.attn_implementation:
        parts.append(f"attn={member.attn_implementation}")
    if member.dtypes is not None:
        parts.append(f"dtypes={'/'.join(member.dtypes)}")
    return f"{member.name}: {', '.join(parts) or 'as captured'}"


# -- merging -----------------------------------------------------------------------------------
def _merge_stats(samples: Sequence[dict[str, float | None]]) -> dict[str, float | None]:
    """The members' worst of every statistic (``compare.calibration.merge_statistics``),
    the spread of ``SPREAD_STATS`` beside it, and the members' count."""
    merged = merge_statistics(samples)
    for key in SPREAD_STATS:
        values = [float(v) for s in samples if (v := s.get(key)) is not None]
        positive = [v for v in values if v > 0 and math.isfinite(v)]
        if len(values) > 1 and positive:
            merged[f"{key}_spread"] = max(positive) / min(positive)
    merged["members"] = float(len(samples))
    return merged


def merge(tables: Sequence[CalibrationJson]) -> CalibrationJson:
    """The ensemble's calibration of one dtype from its members' (every point, output and
    mode any member has; the worst and spread over those that have it)."""
    keys = {
        (p, o, m) for t in tables for p, outs in t.items() for o, ms in outs.items() for m in ms
    }
    result: CalibrationJson = {}
    for point, output, mode in sorted(keys):
        samples = [s for t in tables if (s := t.get(point, {}).get(output, {}).get(mode))]
        result.setdefault(point, {}).setdefault(output, {})[mode] = _merge_stats(samples)
    return result


# -- running a member --------------------------------------------------------------------------
def _run_in_subprocess(
    member: Member,
    golden_path: Path,
    dtypes: Sequence[str],
    trust_remote_code: bool,
    stream: bool = False,
) -> MemberResult:
    """The member's calibrations from ``python -m numalign.replay.ensemble_member`` in a
    subprocess whose environment carries its settings (``subprocess.run`` ends it if this
    process is interrupted, so no member outlives a capture); with ``stream``, its model
    streamed unit by unit (``--stream``)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="numalign-member-") as scratch:
        out = Path(scratch) / "calibration.json"
        command = member_command([str(golden_path), "--dtypes", ",".join(dtypes),
                                  "--out", str(out), "--code", _CODE])  # fmt: skip
        if member.threads:
            command += ["--threads", str(member.threads)]
        if member.attn_implementation:
            command += ["--attn", member.attn_implementation]
        if trust_remote_code:
            command.append("--trust-remote-code")
        if stream:
            command.append("--stream")
        done = subprocess.run(
            command, env=member_environment(member.env), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, check=False,
        )  # fmt: skip
        if done.returncode == CODE_CHANGED:
            raise EnsembleError(
                f"calibration member {describe(member)} did not run: "
                f"{done.stderr.strip().splitlines()[-1]}; its calibration would not be this "
                "capture's: capture again once numalign's code stands still"
            )
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-8:])
            raise EnsembleError(
                f"calibration member {describe(member)} failed (exit {done.returncode}):\n"
                f"{tail}\nname other members with --calibrate-with, or --calibrate-with none "
                "for the reference alone"
            )
        return MemberResult.from_json(json.loads(out.read_text(encoding="utf-8")))


def run_members(
    members: Sequence[tuple[Member, Sequence[str]]],
    golden_path: Path,
    *,
    trust_remote_code: bool = False,
    placement: Placement | None = None,
    step: Callable[[str], None] | None = None,
    stream: bool = False,
) -> list[tuple[Member, MemberResult]]:
    """Each (member, dtypes)'s calibrations, in order, one member at a time: members use
    every core they are given (torch's threads), and members run side by side oversubscribe
    them (docs/golden-sets.md); with ``stream``, each
    member's model streamed unit by unit (``golden.stream``). A member that fails raises
    EnsembleError."""
    results: list[tuple[Member, MemberResult]] = []
    for member, dtypes in members:
        if step is not None:
            step(f"calibrating {', '.join(dtypes)}: {describe(member)}")
        if member.in_process:
            results.append((member, calibrate_member(
                golden_path, dtypes, member.threads, member.attn_implementation,
                trust_remote_code, placement=placement, stream=stream,
            )))  # fmt: skip
            continue
        results.append((member, _run_in_subprocess(member, golden_path, dtypes,
                                                   trust_remote_code, stream)))  # fmt: skip
    return results


# -- calibrating a set -------------------------------------------------------------------------
def is_reference(member: Member) -> bool:
    """The member that runs the reference exactly as it was captured."""
    return member.in_process and not member.threads and not member.attn_implementation


def calibrate_set(
    golden: GoldenSet,
    dtypes: Sequence[str] = DEFAULT_CALIBRATION,
    *,
    members: Sequence[Member] | None = None,
    trust_remote_code: bool = False,
    step: Callable[[str], None] | None = None,
    placement: Placement | None = None,
    stream: bool = False,
) -> None:
    """Calibrates ``golden`` in each of ``dtypes`` over ``members`` (``default_members``
    when None) and stores the merged calibration with the members' descriptions. The
    reference member skips the reference's own dtype (its error there is zero by
    construction); a dtype no member calibrated keeps no calibration. Under ``placement``
    (a model too big for memory) only in-process members run: a subprocess would load the
    whole model again. With ``stream`` every member streams its model unit by unit
    (``golden.stream``), in process and in subprocesses alike: none holds more than a
    layer's weights."""
    if members is None:
        members = default_members(golden.reference.attn_implementation,
                                  device=golden.reference.device)  # fmt: skip
    planned = [
        (m, _member_dtypes(m, dtypes, golden.reference.dtype))
        for m in members
        if placement is None or m.in_process
    ]
    tables: dict[str, list[CalibrationJson]] = {d: [] for d in dtypes}
    ran: dict[str, list[str]] = {d: [] for d in dtypes}
    limits: dict[str, str] = {}
    for member, result in run_members(
        [(m, d) for m, d in planned if d], golden.path, trust_remote_code=trust_remote_code,
        placement=placement, step=step, stream=stream,
    ):  # fmt: skip
        for dtype, table in result.tables.items():
            tables[dtype].append(table)
            ran[dtype].append(describe(member))
        for dtype, reason in result.limits.items():
            limits.setdefault(dtype, f"{reason} (calibration member {describe(member)})")
    for dtype in dtypes:
        if dtype in limits:  # the reference's own code cannot run in it: no calibration
            golden.write_dtype_limit(dtype, limits[dtype])
        elif tables[dtype]:
            merged = merge(tables[dtype])
            if dtype == golden.reference.dtype:
                with_exact_reference(merged)
            golden.write_calibration(dtype, calibration_from_json(merged), members=ran[dtype])


def with_exact_reference(calibration: CalibrationJson) -> None:
    """The reference's own dtype, where the reference member does not run (its error is zero
    by construction): the leans' ranges take in its lean, zero, since replaying the reference
    exactly is honest (members that reorder float32 sums lean by 1e-8, and an exact replay
    must not lie outside their range)."""
    for outputs in calibration.values():
        for modes in outputs.values():
            for stats in modes.values():
                for lean in ("scale", "offset"):
                    low, high = stats.get(f"{lean}_low"), stats.get(f"{lean}_high")
                    if low is not None and high is not None:
                        stats[f"{lean}_low"], stats[f"{lean}_high"] = min(low, 0.0), max(high, 0.0)


def _member_dtypes(member: Member, dtypes: Sequence[str], reference_dtype: str) -> list[str]:
    """The dtypes of ``dtypes`` the member calibrates: those it takes, less the reference's
    own dtype for the reference member (exact there by construction)."""
    return [
        d
        for d in dtypes
        if (member.dtypes is None or d in member.dtypes)
        and not (is_reference(member) and d == reference_dtype)
    ]


def calibration_steps(golden_reference_dtype: str, dtypes: Sequence[str],
                      members: Sequence[Member]) -> int:  # fmt: skip
    """How many progress steps ``calibrate_set`` takes."""
    return sum(bool(_member_dtypes(m, dtypes, golden_reference_dtype)) for m in members)


def capture_calibrated(
    model_dir: str | Path,
    out: str | Path,
    spec: CaptureSpec = CaptureSpec(),
    *,
    calibrate: Sequence[str] = DEFAULT_CALIBRATION,
    members: Sequence[Member] | None = None,
) -> GoldenSet:
    """``numalign capture``: a capture of ``spec`` (``golden.capture.capture``; its
    ``finish`` is this calibration) that is calibrated in ``calibrate`` over the
    ensemble, and its power per point computed from that calibration
    (``replay.set_power``), before it is moved into place, so a set never appears without
    its calibration and power (a line says the power's median scale, unless
    ``spec.progress`` is False). A streamed capture (``spec.stream``, or the automatic
    choice where it is None: ``golden.capture.resolve_stream``) streams every member."""
    # the one dtype parser, before anything loads (ValueError naming the allowed dtypes)
    dtypes = parse_dtypes(",".join(calibrate)) if calibrate else ()
    placement, trust_remote_code = spec.placement, spec.trust_remote_code
    # decided once, here: the capture's reference and every member stream alike
    stream = resolve_stream(model_dir, spec.reference_dtype, spec.stream, placement)
    chosen = (
        list(members)
        if members is not None
        else default_members(spec.attn_implementation or "eager")
    )

    def finish(golden: GoldenSet, step: Callable[[str], None]) -> None:
        calibrate_set(golden, dtypes, members=chosen, trust_remote_code=trust_remote_code,
                      step=step, placement=placement, stream=stream)  # fmt: skip
        if dtypes:  # before the set is placed: a calibrated set never appears without it
            config = model_config(golden.model_dir, trust_remote_code)
            golden.write_power(set_power(golden, config=config))

    steps = calibration_steps(spec.reference_dtype, dtypes, chosen)
    golden = capture(model_dir, out, replace(spec, finish=finish, stream=stream,
                                             finish_steps=steps if dtypes else 0))  # fmt: skip
    if golden.manifest.power and spec.progress is not False:  # as its progress
        print(f"numalign capture {golden.name}: power per point written to its manifest, "
              f"{power_line(golden.manifest.power)}", file=sys.stderr, flush=True)  # fmt: skip
    return golden
