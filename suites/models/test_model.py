"""Full-model replay: the whole model on the device in the target dtype from the golden
inputs, every point against the accumulated calibration; logits (top-1 agreement, top-5
overlap, KL divergence, max abs error); the greedy continuation; and the first divergence,
local (the point alone fails too) or accumulated from upstream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from numalign.golden import GoldenSetError
from numalign.plugin import settings_key
from numalign.record import NodeRecorder
from numalign.replay.model import (
    ModelCache,
    ReplayUnsupported,
    first_divergence,
    replay_layer,
    replay_model,
    suite_sets,
    variant_label,
)

ROOT = Path(__file__).resolve().parents[2]

#: Top-5 overlap below this on average means the output distribution moved, not rounding:
#: bfloat16 replays of the zoo overlap at 0.95 and more.
MIN_TOP5_OVERLAP = 0.8


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "model_case" not in metafunc.fixturenames:
        return
    settings = metafunc.config.stash[settings_key]
    sets = suite_sets(ROOT, settings.golden_dirs)
    ids = [f"{p}::{p.name}-{d}" for p in sets for d in settings.dtypes]
    metafunc.parametrize("model_case", ids, ids=[i.split("::", 1)[1] for i in ids])


@pytest.mark.model
def test_model(
    model_case: str,
    numalign_device: torch.device,
    numalign_settings: Any,
    model_cache: ModelCache,
    tolerance_policy: Any,
    record_drift: NodeRecorder,
) -> None:
    __tracebackhide__ = True
    path, _, rest = model_case.partition("::")
    dtype = rest.rpartition("-")[2]
    try:
        golden, model = model_cache.load(path, numalign_settings, numalign_device, dtype)
    except GoldenSetError as exc:  # a stale or broken set fails with its own message
        pytest.fail(str(exc), pytrace=False)
    except ReplayUnsupported as exc:  # an implementation transformers lacks for this model
        pytest.skip(str(exc))
    replay = replay_model(golden, model, dtype, numalign_device, tolerance_policy)
    divergence = first_divergence(replay.points)
    located = None
    if divergence is not None:
        alone = replay_layer(
            golden, model, golden.point(divergence.point), dtype, numalign_device, tolerance_policy
        )
        kind = "local" if any(not r.result.passed for r in alone) else "accumulated"
        located = {"point": divergence.point, "kind": kind, "request": divergence.request}
    swap = variant_label(numalign_settings)
    for r in replay.points:
        extra = {"first_divergence": located} if located and r is divergence else {}
        record_drift(
            r.result, suite="models", candidate="transformers", device=str(numalign_device),
            case=r.request, golden_fingerprint=golden.manifest["model"]["fingerprint"], swap=swap,
            model=golden.name, mode="accumulated", point_index=r.order, **extra,
        )  # fmt: skip
    problems = []
    if located and divergence is not None:
        why = (
            "the point alone fails too"
            if located["kind"] == "local"
            else "the point alone is within budget; the error comes from upstream"
        )
        problems.append(
            f"first divergence at {located['point']} ({located['kind']}: {why}), request "
            f"{located['request']}:\n{divergence.result.message()}"
        )
    for check in replay.logits:
        if check["top1_unexplained"] or check["top5_overlap"] < MIN_TOP5_OVERLAP:
            problems.append(f"logits of {check['request']}: {check}")
    for check in replay.continuation:
        if not check["ok"]:
            problems.append(f"greedy continuation of {check['request']}: {check}")
    if problems:
        pytest.fail(f"{golden.name} [{dtype}]: " + "\n\n".join(problems), pytrace=False)
