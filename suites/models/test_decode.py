"""Decode replay: every golden request that generates, prefilled with a KV cache and then
decoded step by step (teacher-forced with the golden tokens), with each cache implementation
asked for (``--cache-implementation``: dynamic, static, offloaded, offloaded_static, and the
paged serving path). Each step's new-token outputs at every capture point, its logits, and the
cache's contents after the prefill and after the last step are judged against the golden ones
within the set's decode calibration; the first divergent step and point are named. Every
comparison is a drift record (mode ``decode``, ``step`` set, ``swap`` naming the cache).

Ids read ``test_decode[tiny-llama-bfloat16-static]``; with ``--serving``, one test per
arrangement, ``test_decode[tiny-mistral-float32-paged-preempted]``.
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
from numalign.replay.engines import Engine, decode_caches
from numalign.replay.sets import suite_sets
from numalign.replay.verdict import records
from numalign.runtime.compiled import GraphBreakWarning

ROOT = Path(__file__).resolve().parents[2]
# Graph breaks under --compile are reported, not failures (as in test_model).
pytestmark = pytest.mark.filterwarnings(
    f"default::{GraphBreakWarning.__module__}.GraphBreakWarning"
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "decode_case" not in metafunc.fixturenames:
        return
    settings = metafunc.config.stash[settings_key]
    sets = suite_sets(ROOT, settings.golden_dirs, only=settings.golden_only)
    cases = [
        replay_param(
            ReplayCase(str(p), d, cache=c, serving=s), testids.format_decode(p.name, d, c, s)
        )
        for p in sets
        for d in settings.dtypes
        for c in decode_caches(settings)
        for s in settings.serving
    ]
    metafunc.parametrize("decode_case", cases)


@pytest.mark.decode
@pytest.mark.model
def test_decode(
    decode_case: testids.Param,
    numalign_device: torch.device,
    numalign_settings: Any,
    replay_engine: Engine,
    tolerance_policy: Any,
    record_drift: NodeRecorder,
    replay_guard: Any,
) -> None:
    __tracebackhide__ = True
    case: ReplayCase = decode_case.values
    path, dtype, implementation = case.path, str(case.dtype), str(case.cache)
    with replay_guard():
        replayed = replay_engine.decode(
            path, dtype, implementation, numalign_device, tolerance_policy, serving=case.serving
        )
    verdict = replayed.verdict
    for record in records(verdict, record_drift.nodeid, **replayed.context):
        record_drift.add(record)
    if not verdict.passed:
        message = verdict.message(f"{replayed.golden.name} [{dtype}]")
        # measured, reported, and its signature matches: expected, its records kept
        failed_verdict(message, replayed.known)
