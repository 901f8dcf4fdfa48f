"""Helpers for the report tests: synthetic records of every suite, a deep model's included."""

from __future__ import annotations

import zlib

import pytest
import torch

from numalign.compare import CompareSpec, compare
from numalign.records.drift import DriftRecord

#: Layers of the synthetic deep model: more than 30, where a chart per point is unreadable.
DEEP_LAYERS = 32
#: The synthetic model's requests (two records of each point).
REQUESTS = ("text-leftpad", "text-rightpad")


def operator_record(
    point: str, dtype: str, scale: float, *, candidate: str = "fused", case: str = "c"
) -> DriftRecord:
    """A real comparison's record: truth randn, candidate off by a relative ``scale`` with
    signs at random (a drift, not a systematic scale, which the distribution rule fails)."""
    # a stable seed: str hash() changes with every interpreter (PYTHONHASHSEED), which made
    # the records, and the tests that grow their budget use, differ from run to run
    gen = torch.Generator().manual_seed(zlib.crc32(f"{point}|{dtype}|{case}".encode()))
    truth = torch.randn(256, generator=gen, dtype=torch.float64)
    dt = getattr(torch, dtype)
    signs = torch.randint(0, 2, (256,), generator=gen, dtype=torch.float64) * 2 - 1
    result = compare(
        (truth * (1 + scale * signs)).to(dt), truth, CompareSpec(control=truth.to(dt), name=point)
    )
    return DriftRecord.from_result(
        result,
        test_id=f"suites/operators/test_operators.py::test_{point}[{candidate}-{dtype}-{case}]",
        suite="operators",
        candidate=candidate,
        device="cpu",
        case=case,
    )


def model_records(model: str, dtype: str, layers: int = 6) -> list[DriftRecord]:
    """Records of the model suites for every request: each layer's block, attention, MLP and
    norms, isolated and accumulated, the accumulated drift growing with depth; the logits and
    the continuation."""
    out = []
    for i in range(layers):
        for child, base in (("", 1.0), (".self_attn", 0.7), (".mlp", 0.8),
                            (".input_layernorm", 0.3)):  # fmt: skip
            point = f"model.layers.{i}{child}"
            for mode, growth in (("isolated", 1.0), ("accumulated", 1.15**i)):
                for request in REQUESTS:
                    r = operator_record(point, dtype, 0.001 * base * growth, case=request)
                    test = (
                        f"suites/models/test_layers.py::test_layer[{model}/{point}-{dtype}]"
                        if mode == "isolated"
                        else f"suites/models/test_model.py::test_model[{model}-{dtype}]"
                    )
                    out.append(r.with_fields(suite="models", model=model, mode=mode,
                                             point_index=i, request=request, output="0",
                                             test_id=test, candidate="transformers"))  # fmt: skip
    deep = [r for r in out if r.mode == "accumulated" and r.point == f"model.layers.{layers - 1}"]
    deep[0].first_divergence = {"point": f"model.layers.{layers - 1}", "kind": "accumulated",
                                "request": REQUESTS[0]}  # fmt: skip
    model_test = f"suites/models/test_model.py::test_model[{model}-{dtype}]"
    for request in REQUESTS:
        logits = operator_record("logits", dtype, 0.002, case=request).with_fields(
            suite="models", model=model, mode="logits", request=request, test_id=model_test
        )
        logits.metrics |= {"top1_agreement": 1.0, "top5_overlap": 0.96, "kl_max": 1e-3}
        logits.budget |= {"kl_max": 1.6e-2}
        out.append(logits)
    out.append(DriftRecord.for_test(
        model_test, "passed", point="continuation", mode="continuation", request=REQUESTS[0],
        rule="continuation", reason="every greedy token agrees", budget_used=0.0,
        metrics={"steps": 8, "first_divergence": None, "gap": 0.0}, model=model,
    ))  # fmt: skip
    return out


#: A drift of about half an ulp: passes, with a visible use of the budget.
DRIFT = {"float32": 6e-8, "bfloat16": 2e-3}


@pytest.fixture
def run_records() -> list[DriftRecord]:
    records = [
        operator_record(op, dtype, scale, case=case)
        for op in ("rms_norm", "softmax", "attention")
        for dtype in ("float32", "bfloat16")
        for case, scale in (("ok", 0.0), ("drift", DRIFT[dtype]))
    ]
    records.append(operator_record("gelu", "bfloat16", 0.05, case="broken"))
    records += model_records("tiny-llama", "bfloat16")
    return records


@pytest.fixture
def deep_records() -> list[DriftRecord]:
    """A deep model's run: 32 layers, a local divergence at a norm in layer 9 of one request
    that every later point inherits, and a failing logits check."""
    records = model_records("deep-llama", "bfloat16", layers=DEEP_LAYERS)
    for r in records:
        if r.point_index is not None and r.point_index >= 9 and r.mode == "accumulated":
            r.verdict, r.rule, r.budget_used = "failed", "distribution", 1.5 + r.point_index / 10
            r.message = f"{r.point} [bfloat16] is not aligned: the norm ratio is 1.01"
        r.first_divergence = None
    first = next(r for r in records if r.point == "model.layers.9.input_layernorm"
                 and r.mode == "accumulated")  # fmt: skip
    first.first_divergence = {"point": first.point, "kind": "local", "request": first.request}
    logits = next(r for r in records if r.mode == "logits")
    logits.verdict, logits.rule, logits.budget_used = "failed", "logits", 3.0
    logits.message = "logits of text-leftpad: KL divergence 0.05 exceeds its budget 0.016"
    return records
