"""Full-model replay: the whole model on the device in the target dtype from the golden
inputs, every point against the accumulated calibration; the logits (values, top-1 and top-5
agreement with near ties, KL divergence) or an encoder's final outputs; the greedy
continuation; and the first divergence, local (the point alone fails too) or accumulated from
upstream. Every one of them is a drift record.

Ids read ``test_model[tiny-llama-bfloat16]``; with ``--serving`` (a serving engine) one test
per arrangement, ``test_model[tiny-mistral-float32-prefix-cached]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from numalign.plugin import settings_key
from numalign.records import testids
from numalign.records.drift import NodeRecorder
from numalign.records.outcomes import failed_verdict
from numalign.records.testids import ReplayCase, replay_param
from numalign.replay.engines import Engine
from numalign.replay.sets import suite_sets
from numalign.replay.verdict import records
from numalign.runtime.compiled import GraphBreakWarning

ROOT = Path(__file__).resolve().parents[2]
# Graph breaks under --compile are reported (a warning with Dynamo's reasons, and the
# records' graph_breaks), not failures: the parts between breaks still run compiled.
pytestmark = pytest.mark.filterwarnings(
    f"default::{GraphBreakWarning.__module__}.GraphBreakWarning"
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "model_case" not in metafunc.fixturenames:
        return
    settings = metafunc.config.stash[settings_key]
    sets = suite_sets(ROOT, settings.golden_dirs, only=settings.golden_only)
    cases = [
        replay_param(ReplayCase(str(p), d, serving=s), testids.format_model(p.name, d, s))
        for p in sets
        for d in settings.dtypes
        for s in settings.serving
    ]
    metafunc.parametrize("model_case", cases)


@pytest.mark.model
def test_model(
    model_case: testids.Param,
    numalign_device: torch.device,
    numalign_settings: Any,
    replay_engine: Engine,
    tolerance_policy: Any,
    record_drift: NodeRecorder,
    replay_guard: Any,
) -> None:
    __tracebackhide__ = True
    case: ReplayCase = model_case.values
    path, dtype = case.path, str(case.dtype)
    with replay_guard():
        replayed = replay_engine.model(
            path, dtype, numalign_device, tolerance_policy, serving=case.serving
        )
    verdict = replayed.verdict
    for record in records(verdict, record_drift.nodeid, **replayed.context):
        record_drift.add(record)
    if not verdict.passed:
        failed_verdict(verdict.message(f"{replayed.golden.name} [{dtype}]"), replayed.known)
