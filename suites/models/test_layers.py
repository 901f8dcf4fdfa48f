"""Layer replay: every capture point of every golden set, its module (from the model loaded
with from_pretrained on the device in the target dtype) fed the golden inputs, its outputs
against the golden ones within the set's isolated calibration for that dtype.

Ids read ``test_layer[tiny-llama/model.layers.1.mlp-bfloat16]``; a set whose manifest cannot
be read is one failing case, ``test_layer[NAME/(unreadable)]``, with one error record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from numalign.compare.model_verdict import layer_message
from numalign.golden import GoldenSet, GoldenSetError
from numalign.plugin import settings_key
from numalign.records import testids
from numalign.records.drift import NodeRecorder
from numalign.records.outcomes import failed_verdict
from numalign.records.testids import ReplayCase, replay_param
from numalign.replay.engines import Engine
from numalign.replay.sets import suite_sets
from numalign.replay.verdict import point_record
from numalign.runtime.compiled import GraphBreakWarning

ROOT = Path(__file__).resolve().parents[2]
# Graph breaks under --compile are reported (a warning with Dynamo's reasons, and the
# records' graph_breaks), not failures: the parts between breaks still run compiled.
pytestmark = pytest.mark.filterwarnings(
    f"default::{GraphBreakWarning.__module__}.GraphBreakWarning"
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "layer_case" not in metafunc.fixturenames:
        return
    settings = metafunc.config.stash[settings_key]
    sets = suite_sets(ROOT, settings.golden_dirs, only=settings.golden_only)
    cases = []
    for path in sets:
        try:
            golden = GoldenSet.open_shared(path)
        except GoldenSetError:  # one failing case for the set, never a collection error
            name = testids.format_unreadable_layer(path.name)
            cases.append(replay_param(ReplayCase(str(path)), name))
            continue
        for point in golden.points:
            for dtype in settings.dtypes:
                name = testids.format_layer(golden.name, point.name, dtype)
                cases.append(replay_param(ReplayCase(str(path), dtype, point.name), name))
    metafunc.parametrize("layer_case", cases)


@pytest.mark.layer
@pytest.mark.model
def test_layer(
    layer_case: testids.Param,
    numalign_device: torch.device,
    numalign_settings: Any,
    replay_engine: Engine,
    tolerance_policy: Any,
    record_drift: NodeRecorder,
    replay_guard: Any,
) -> None:
    __tracebackhide__ = True
    case: ReplayCase = layer_case.values
    path, point_name, dtype = case.path, case.point, case.dtype
    with replay_guard():
        if point_name is None or dtype is None:  # the set was unreadable at collection
            GoldenSet.open_shared(path)  # raises its error: one error record for the set
            pytest.fail(f"{path}: unreadable when the tests were collected; run them again")
        replayed = replay_engine.layer(path, point_name, dtype, numalign_device, tolerance_policy)
    for r in replayed.verdict:
        record_drift.add(point_record(r, record_drift.nodeid, **replayed.context))
    message = layer_message(f"{replayed.golden.name}/{point_name} [{dtype}]", replayed.verdict)
    if message:
        failed_verdict(message, replayed.known)
