"""One member of the calibration ensemble (``numalign.replay.ensemble``): the reference
calibrated in each dtype with this process's kernels, a thread count and an attention
implementation. Run as ``python -m numalign.replay.ensemble_member SET --dtypes D,... --out
FILE`` in a subprocess whose environment selects the kernels (``ONEDNN_MAX_CPU_ISA``,
``ATEN_CPU_CAPABILITY``, which torch reads when it loads); it writes its ``MemberResult`` as
JSON. ``--code FINGERPRINT`` is the capture's ``code_fingerprint``: a member whose numalign
is other code (the checkout changed under a running capture) exits with ``CODE_CHANGED``
instead of calibrating with it.

A member imports the numalign the capture runs, whatever the working directory holds (the
parent of a clone holds a folder named ``numalign``): ``member_command`` runs Python with
``-P`` (no working directory on ``sys.path``) and ``member_environment`` puts the folder the
capture's numalign was imported from first on ``PYTHONPATH``."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import site
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.golden.manifest import CalibrationJson
from numalign.golden.store import GoldenSet
from numalign.replay.calibrate import DtypeUnsupported, calibrate

if TYPE_CHECKING:
    from numalign.golden.reference import Placement

#: The exit status of a member whose numalign is not the capture's (``--code``).
CODE_CHANGED = 3


def code_fingerprint() -> str:
    """sha256 over numalign's own source files (each one's path in the package and its
    bytes, in path order), as they are on disk now: a capture and its members in
    subprocesses run the same numalign only where theirs agree."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def member_command(args: Sequence[str]) -> list[str]:
    """The command line of a member in a subprocess with ``args`` (``main``'s): this
    interpreter, ``-P`` so that the working directory is not on ``sys.path`` (a folder named
    ``numalign`` there would be imported instead of numalign)."""
    return [sys.executable, "-P", "-m", "numalign.replay.ensemble_member", *args]


def member_environment(settings: Mapping[str, str]) -> dict[str, str]:
    """The environment of a member in a subprocess: this process's, ``PYTHONPATH`` starting
    with the folder this numalign was imported from (a source tree's ``src``, or an editable
    install's, which the interpreter would otherwise find after ``sys.path``) unless it is a
    site-packages folder the interpreter searches anyway, and the member's ``settings`` last
    (a member that names its own ``PYTHONPATH`` gets it as it is)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    searched = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if root not in searched:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(root), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
        )
    return env | dict(settings)


@dataclass
class MemberResult:
    """A member's calibrations by dtype, and the dtypes the reference's own code cannot run
    in (dtype -> its error, ``calibrate.DtypeUnsupported``), which have none."""

    tables: dict[str, CalibrationJson] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"tables": self.tables, "limits": self.limits}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MemberResult:
        return cls(dict(data["tables"]), dict(data.get("limits", {})))


def calibrate_member(
    golden_path: Path,
    dtypes: Sequence[str],
    threads: int | None,
    attn_implementation: str | None,
    trust_remote_code: bool,
    *,
    placement: Placement | None = None,
    stream: bool = False,
) -> MemberResult:
    """The calibrations of the set at ``golden_path`` with ``threads`` (None: as set) and
    ``attn_implementation`` (None: the set's own), and the dtypes the reference cannot run
    in; with ``stream``, the model streamed unit by unit (``golden.stream``), as a streamed
    capture's reference."""
    import torch

    golden = GoldenSet.open(golden_path)
    own = golden.reference.attn_implementation
    attn = attn_implementation or own
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    result = MemberResult()
    try:
        for dtype in dtypes:
            try:
                try:
                    result.tables[dtype] = calibrate(
                        golden, golden.model_dir, dtype, attn_implementation=attn,
                        trust_remote_code=trust_remote_code, placement=placement,
                        stream=stream,
                    )  # fmt: skip
                except ValueError as exc:
                    # a model without this attention implementation (Gemma 2 has no SDPA
                    # path): the member keeps its other settings with the set's own attention
                    if attn == own or "attention" not in str(exc):
                        raise
                    attn = own
                    result.tables[dtype] = calibrate(
                        golden, golden.model_dir, dtype, attn_implementation=attn,
                        trust_remote_code=trust_remote_code, placement=placement,
                        stream=stream,
                    )  # fmt: skip
            except DtypeUnsupported as exc:  # the model's own limit: no calibration of it
                result.limits[dtype] = exc.reason
        return result
    finally:
        torch.set_num_threads(before)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="numalign.replay.ensemble_member", allow_abbrev=False)
    parser.add_argument("set", type=Path, help="the golden set folder")
    parser.add_argument("--dtypes", required=True, help="comma list of dtypes to calibrate")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON goes")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--attn", default=None, help="attention implementation (default: the set's)"
    )
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument(
        "--stream", action="store_true", help="stream the model's weights unit by unit"
    )
    parser.add_argument("--code", default=None, help="the capture's code_fingerprint")
    args = parser.parse_args(argv)
    if args.code is not None and args.code != code_fingerprint():
        print(
            f"numalign's code under {Path(__file__).resolve().parents[1]} is not the code the "
            "capture started with (it changed while the capture ran, or this member imports "
            "another numalign)",
            file=sys.stderr,
        )
        return CODE_CHANGED
    result = calibrate_member(args.set, [d for d in args.dtypes.split(",") if d], args.threads,
                              args.attn, args.trust_remote_code, stream=args.stream)  # fmt: skip
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.to_json()), encoding="utf-8")
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
