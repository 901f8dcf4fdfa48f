"""The model suites' replays of one golden set, run in this process: the records
``suites/models`` would write for the tests a ``-k`` selects, through the same engine, judge
and record functions, without a pytest session per planted bug (tests/replay/
test_model_suites.py runs the suites themselves)."""

from __future__ import annotations

from pathlib import Path

import torch

from numalign.compare import load_policy
from numalign.core.errors import Unsupported
from numalign.golden import GoldenSet
from numalign.records import testids
from numalign.records.drift import DriftRecord
from numalign.replay.engines.transformers import TransformersEngine
from numalign.replay.verdict import point_record, records
from numalign.session.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
SETS = ROOT / "golden" / "sets"
#: The suites' files, for the test ids the records carry (what ``test_dtype`` parses).
LAYERS, MODEL, DECODE = (f"suites/models/{f}" for f in ("test_layers.py", "test_model.py",
                                                        "test_decode.py"))  # fmt: skip


def replay_records(
    golden_set: str | Path,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    *,
    points: tuple[str, ...] = (),
    model: bool = False,
    caches: tuple[str, ...] = (),
) -> list[DriftRecord]:
    """The records of ``golden_set`` (a zoo set's name or a folder) replayed in ``dtypes``:
    alone, every point whose name holds one of ``points`` (as ``-k`` selects test_layer); the
    whole model (test_model) with ``model``; decode in each of ``caches`` (test_decode). A
    replay the engine cannot run here (``Unsupported``) leaves no record, as the suites skip
    it."""
    path = Path(golden_set) if "/" in str(golden_set) else SETS / str(golden_set)
    golden = GoldenSet.open(path)
    engine = TransformersEngine(Settings(dtypes=dtypes))
    device, policy = torch.device("cpu"), load_policy(ROOT / "pyproject.toml")
    found: list[DriftRecord] = []
    try:
        for dtype in dtypes:
            for point in golden.points:
                if not any(p in point.name for p in points):
                    continue
                test_id = (
                    f"{LAYERS}::test_layer[{testids.format_layer(path.name, point.name, dtype)}]"
                )
                try:
                    done = engine.layer(path, point.name, dtype, device, policy)
                except Unsupported:
                    continue
                found += [point_record(r, test_id, **done.context) for r in done.verdict]
            if model:
                test_id = f"{MODEL}::test_model[{testids.format_model(path.name, dtype)}]"
                done = engine.model(path, dtype, device, policy)
                found += records(done.verdict, test_id, **done.context)
            for cache in caches:
                name = testids.format_decode(path.name, dtype, cache)
                try:
                    done = engine.decode(path, dtype, cache, device, policy)
                except Unsupported:
                    continue
                found += records(done.verdict, f"{DECODE}::test_decode[{name}]", **done.context)
    finally:
        engine.close()
    return found
