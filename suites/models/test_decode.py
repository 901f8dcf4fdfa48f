"""Decode replay: every golden request that generates, prefilled with a KV cache and then
decoded step by step (teacher-forced with the golden tokens), with each cache implementation
asked for (``--cache-implementation``: dynamic, static, offloaded, offloaded_static, and the
paged serving path). Each step's new-token outputs at every capture point, its logits, and the
cache's contents after the prefill and after the last step are judged against the golden ones
within the set's decode calibration; the first divergent step and point are named. Every
comparison is a drift record (mode ``decode``, ``step`` set, ``swap`` naming the cache).

Ids read ``test_decode[tiny-llama-bfloat16-static]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from numalign.plugin import settings_key
from numalign.record import NodeRecorder
from numalign.replay.compiled import GraphBreakWarning
from numalign.replay.decode import decode_unavailable
from numalign.replay.model import ModelCache, suite_sets
from numalign.replay.serving import decode_replay, known_divergence

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
    ids = [
        f"{p}::{p.name}-{d}-{c}"
        for p in sets
        for d in settings.dtypes
        for c in settings.cache_implementations
    ]
    metafunc.parametrize("decode_case", ids, ids=[i.split("::", 1)[1] for i in ids])


@pytest.mark.decode
@pytest.mark.model
def test_decode(
    decode_case: str,
    numalign_device: torch.device,
    numalign_settings: Any,
    model_cache: ModelCache,
    tolerance_policy: Any,
    record_drift: NodeRecorder,
    replay_guard: Any,
) -> None:
    __tracebackhide__ = True
    path, _, rest = decode_case.partition("::")
    rest, _, implementation = rest.rpartition("-")
    dtype = rest.rpartition("-")[2]
    with replay_guard():
        golden, model, verdict = decode_replay(
            model_cache, path, numalign_settings, numalign_device, dtype, implementation,
            tolerance_policy,
        )  # fmt: skip
    if verdict is None:
        pytest.skip(decode_unavailable(golden, dtype) or "no decode steps")
    context = model_cache.record_context(golden, numalign_settings, numalign_device, model)
    context["swap"] = ",".join(filter(None, [context["swap"], f"cache={implementation}"]))
    for record in verdict.records(record_drift.nodeid, **context):
        record_drift.add(record)
    if not verdict.passed:
        message = verdict.message(f"{golden.name} [{dtype}]")
        known = known_divergence(golden, model, verdict, dtype, numalign_device, implementation)
        if known:  # measured, reported, and its signature matches: expected, records kept
            pytest.xfail(f"known divergence: {known}\n{message}")
        pytest.fail(message, pytrace=False)
