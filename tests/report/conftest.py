"""Helpers for the report tests: synthetic records of every suite."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from numalign.compare import compare
from numalign.record import make_record


def operator_record(
    point: str, dtype: str, scale: float, *, candidate: str = "fused", case: str = "c"
) -> dict[str, Any]:
    """A real comparison's record: truth randn, candidate off by a relative ``scale``."""
    gen = torch.Generator().manual_seed(abs(hash((point, dtype, case))) % 2**31)
    truth = torch.randn(256, generator=gen, dtype=torch.float64)
    dt = getattr(torch, dtype)
    result = compare((truth * (1 + scale)).to(dt), truth, control=truth.to(dt), name=point)
    return make_record(
        result,
        test_id=f"suites/operators/test_operators.py::test_{point}[{candidate}-{dtype}-{case}]",
        suite="operators",
        candidate=candidate,
        device="cpu",
        case=case,
    )


def model_records(model: str, dtype: str, layers: int = 6) -> list[dict[str, Any]]:
    """Records of a model suite: isolated and accumulated drift per capture point."""
    out = []
    for i in range(layers):
        point = f"model.layers.{i}"
        for mode, growth in (("isolated", 1.0), ("accumulated", 1.5**i)):
            record = operator_record(point, dtype, 0.001 * growth, case=mode)
            record.update(
                suite="models", model=model, mode=mode, point_index=i,
                test_id=f"suites/models/test_layers.py::{model}/{point}[{dtype}-{mode}]",
            )  # fmt: skip
            out.append(record)
    out[-1]["first_divergence"] = {"point": "model.layers.5", "kind": "accumulated"}
    return out


#: A drift of about half an ulp: passes, with a visible use of the budget.
DRIFT = {"float32": 6e-8, "bfloat16": 2e-3}


@pytest.fixture
def run_records() -> list[dict[str, Any]]:
    records = [
        operator_record(op, dtype, scale, case=case)
        for op in ("rms_norm", "softmax", "attention")
        for dtype in ("float32", "bfloat16")
        for case, scale in (("ok", 0.0), ("drift", DRIFT[dtype]))
    ]
    records.append(operator_record("gelu", "bfloat16", 0.05, case="broken"))
    records += model_records("tiny-llama", "bfloat16")
    return records
