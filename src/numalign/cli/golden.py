"""numalign golden: list, show, verify, upgrade golden sets and their power."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from numalign.cli.common import subparser
from numalign.golden.store import DEFAULT_SETS, discover_sets


def _golden(args: argparse.Namespace) -> int:
    from numalign.golden import GoldenSet

    if args.action == "ls":
        return _golden_ls(Path(args.target or DEFAULT_SETS))
    if not args.target:
        print(f"numalign golden {args.action}: give a golden set folder", file=sys.stderr)
        return 2
    g = GoldenSet.open(_set_folder(args.target))
    if args.action == "verify":
        g.verify(contents=True)
        g.check_fresh()
        print(
            f"{g.path}: {len(g.manifest.shards)} shard(s) and {len(g.manifest.tensors)} "
            "tensor(s) verified; model fresh"
        )
        return 0
    if args.action == "power":
        return _golden_power(g)
    if args.action == "upgrade":
        was = g.upgrade()
        print(f"{g.path}: " + (f"{was} rewritten as {g.manifest.format}" if was
                               else f"already {g.manifest.format}"))  # fmt: skip
        return 0
    m, ref = g.manifest, g.reference
    print(f"set        {g.path}")
    print(f"model      {g.model.name} ({g.model.architecture}) at {g.model_dir}")
    print(f"fingerprint {g.model.fingerprint}")
    print(f"reference  {ref.dtype} on {ref.device}, attention {ref.attn_implementation}, "
          f"torch {ref.torch}, transformers {ref.transformers}")  # fmt: skip
    print(f"requests   {', '.join(r.name for r in g.requests)}")
    print(f"calibrated {', '.join(m.calibration) or 'no'}")
    for dtype, members in m.ensemble.items():
        print(f"  {dtype:9} over {len(members)} member(s): {'; '.join(members)}")
    print(
        f"size       {g.disk_bytes() / 1e6:.2f} MB on disk, "
        f"{g.unique_tensor_bytes() / 1e6:.2f} MB of unique tensors"
    )
    _show_power(m.power)
    for point in g.points:
        calls = [c for request in point.calls.values() for c in request]
        outputs = ", ".join(
            f"{path}: {_described(m.tensors.get(key))}"
            for path, key in (calls[0].outputs.items() if calls else ())
        )
        print(f"  {point.name:52} {point.type:28} {outputs or '(no calls)'}")
    return 0


def _golden_power(g: Any) -> int:
    """``golden power``: the set's power per point computed from its calibration and
    written into its manifest (its model checked fresh first: the figures are of it)."""
    from numalign.replay.set_power import power_line, set_power

    g.check_fresh()
    started = time.monotonic()
    power = set_power(g)
    g.write_power(power)
    outputs = sum(len(modes) for points in power.values() for outputs in points.values()
                  for modes in outputs.values())  # fmt: skip
    print(f"{g.path}: power of {outputs} point output(s) and mode(s) written in "
          f"{time.monotonic() - started:.1f} s; {power_line(power)}")  # fmt: skip
    return 0


def _show_power(power: Any) -> None:
    """``golden show``'s lines of the set's power: per dtype and mode, the median and worst
    figure over its point outputs (or that the set holds none)."""
    from numalign.replay.set_power import power_summary

    if not power:
        print("power      none stored (numalign golden power SET computes it)")
        return
    print("power      what a pass catches: scale relative, bias in RMS (median / worst)")
    for dtype, modes in power_summary(power).items():
        for mode, s in modes.items():
            print(f"  {dtype:9} {mode:11} scale {s['scale_median']:.3g} / {s['scale_worst']:.3g}"
                  f"  bias {s['bias_median']:.3g} / {s['bias_worst']:.3g}"
                  f"  ({int(s['outputs'])} outputs)")  # fmt: skip


def _set_folder(target: str) -> Path:
    """A set's folder from what ``golden show|verify|power`` was given: a folder, or the name of a
    set under the default sets folder as ``golden ls`` prints it (a folder of that name
    where the command runs comes first)."""
    folder = Path(target)
    named = Path(DEFAULT_SETS) / target
    if not folder.is_dir() and folder.parent == Path(".") and named.is_dir():
        return named
    return folder


def _described(info: object) -> str:
    """A tensor's dtype and shape from the manifest, or what is wrong (show never raises)."""
    if info is None:
        return "MISSING from the manifest (numalign golden verify)"
    return f"{getattr(info, 'dtype', '?')}{getattr(info, 'shape', '?')}"


def _golden_ls(folder: Path) -> int:
    """One line per set under ``folder``; a set that cannot be read is a line saying why
    (exit 1), never the end of the listing."""
    from numalign.golden import GoldenSet, GoldenSetError

    if not folder.is_dir():
        print(f"numalign golden ls: {folder}: no such folder", file=sys.stderr)
        return 2
    status = 0
    for path in discover_sets([folder]):
        try:
            g = GoldenSet.open(path)
            fresh = "fresh" if g.model_dir.is_dir() and g.fingerprint_matches() else "STALE"
            print(f"{g.name:24} {g.model.architecture:36} {len(g.points):4} points "
                  f"{g.disk_bytes() / 1e6:8.2f} MB  {fresh}")  # fmt: skip
        except (GoldenSetError, OSError, ValueError) as exc:
            print(f"{path.name:24} BROKEN: {exc}")
            status = 1
    return status


def add_golden(commands: Any) -> None:
    """numalign golden ls | show | verify | power | upgrade"""
    golden = subparser(commands, "golden", help="list, show and verify golden sets")
    golden.add_argument(
        "action", choices=["ls", "show", "verify", "power", "upgrade"],
        help="ls: the sets of a folder; show: one set's contents; verify: its checksums and "
        "its model's fingerprint; power: (re)compute and store what a pass at each point "
        "would catch, from its calibration; upgrade: rewrite a format 3 manifest in the "
        "current format (its output kinds stored)",
    )  # fmt: skip
    golden.add_argument(
        "target", nargs="?",
        help=f"a set folder or a set's name under {DEFAULT_SETS} (ls: a folder of sets, "
        f"none: {DEFAULT_SETS})",
    )  # fmt: skip
    golden.set_defaults(handler=_golden)
