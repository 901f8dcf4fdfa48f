"""One member of the calibration ensemble (``numalign.replay.ensemble``): the reference
calibrated in each dtype with this process's kernels, a thread count and an attention
implementation. Run as ``python -m numalign.replay.ensemble_member SET --dtypes D,... --out
FILE`` in a subprocess whose environment selects the kernels (``ONEDNN_MAX_CPU_ISA``,
``ATEN_CPU_CAPABILITY``, which torch reads when it loads); it writes {dtype: calibration} as
JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from numalign.golden.manifest import CalibrationJson
from numalign.golden.store import GoldenSet
from numalign.replay.calibrate import calibrate

if TYPE_CHECKING:
    from numalign.golden.reference import Placement


def calibrate_member(
    golden_path: Path,
    dtypes: Sequence[str],
    threads: int | None,
    attn_implementation: str | None,
    trust_remote_code: bool,
    *,
    placement: Placement | None = None,
) -> dict[str, CalibrationJson]:
    """{dtype: calibration} of the set at ``golden_path`` with ``threads`` (None: as set) and
    ``attn_implementation`` (None: the set's own)."""
    import torch

    golden = GoldenSet.open(golden_path)
    own = golden.reference.attn_implementation
    attn = attn_implementation or own
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    tables: dict[str, CalibrationJson] = {}
    try:
        for dtype in dtypes:
            try:
                tables[dtype] = calibrate(golden, golden.model_dir, dtype, attn_implementation=attn,
                                          trust_remote_code=trust_remote_code,
                                          placement=placement)  # fmt: skip
            except ValueError as exc:
                # a model without this attention implementation (Gemma 2 has no SDPA path):
                # the member keeps its other settings with the set's own attention
                if attn == own or "attention" not in str(exc):
                    raise
                attn = own
                tables[dtype] = calibrate(golden, golden.model_dir, dtype, attn_implementation=attn,
                                          trust_remote_code=trust_remote_code,
                                          placement=placement)  # fmt: skip
        return tables
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
    args = parser.parse_args(argv)
    tables = calibrate_member(args.set, [d for d in args.dtypes.split(",") if d], args.threads,
                              args.attn, args.trust_remote_code)  # fmt: skip
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(tables), encoding="utf-8")
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
