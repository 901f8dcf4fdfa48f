"""The execution variant: built once from the settings, its label the string records always
carried in ``swap``, its fields the records' (schema 3), and the model cache's key."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from numalign.records.drift import DriftRecord
from numalign.report.variants import compile_label
from numalign.runtime.compiled import CompileSpec
from numalign.runtime.variant import Variant
from numalign.session.settings import Settings

#: Every variant option of the model suites at once.
ALL = Settings(
    swaps=("rms_norm=fused", "silu_and_mul=torch"), attn_implementation="sdpa",
    experts_implementation="grouped_mm", compile_backend="inductor",
    compile_mode="max-autotune", tp=2,
)  # fmt: skip


def test_the_label_is_the_string_records_carried_before() -> None:
    """The order and spelling of ``swap`` as ``replay.model.variant_label`` wrote it (and
    the decode engines' ``cache=`` after it), so reports and old readers see no change."""
    assert Variant.from_settings(Settings()).label is None
    assert Variant.from_settings(ALL).label == (
        "rms_norm=fused,silu_and_mul=torch,attention=sdpa,experts=grouped_mm,"
        "compile=inductor:max-autotune,tp=2"
    )
    assert Variant.from_settings(Settings(), cache="static").label == "cache=static"
    assert Variant.from_settings(Settings(compile_backend="aot_eager"), cache="paged").label == (
        "compile=aot_eager,cache=paged"
    )
    vllm = Variant.from_settings(Settings(engine="vllm"), cache="dynamic").with_changes(
        engine_variant="engine=vllm-0.1,vllm-attention=TorchSDPA,vllm-graph=eager"
    )
    assert vllm.label == "engine=vllm-0.1,vllm-attention=TorchSDPA,vllm-graph=eager,cache=dynamic"


def test_the_operator_suite_variant_is_the_compile_variant_alone() -> None:
    """``pytest suites --swap ... --compile`` swaps kernels in models only: an operator
    record names the compile variant, as it did."""
    variant = Variant.for_operators(ALL, device="cpu", dtype="bfloat16")
    assert variant.label == "compile=inductor:max-autotune"
    assert (variant.engine, variant.swaps, variant.tp, variant.device) == (None, (), 1, "cpu")
    assert Variant.for_operators(Settings()).label is None


def test_the_record_fields_are_read_back_by_the_reports() -> None:
    variant = Variant.from_settings(ALL, device="cpu", dtype="float16", cache="static")
    fields = variant.record_fields()
    assert fields["swap"] == variant.label and "device" not in fields and "dtype" not in fields
    record = DriftRecord.from_dict(DriftRecord(test_id="t", **fields).to_dict())
    assert (record.engine, record.attention, record.experts, record.tp, record.cache) == (
        "transformers", "sdpa", "grouped_mm", 2, "static",
    )  # fmt: skip
    assert record.swaps == ["rms_norm=fused", "silu_and_mul=torch"]
    assert compile_label(record) == "compile=inductor:max-autotune"
    eager = DriftRecord(test_id="t", **Variant.from_settings(Settings()).record_fields())
    assert compile_label(eager) is None


def test_the_variant_keys_the_model_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """One model per set and variant: decode's caches share it; the set's own attention
    implementation is the default one; a compile variant, a dtype or a swap is another."""
    from numalign.replay.model import ModelCache

    loaded: list[Variant] = []

    def load(self: ModelCache, golden: Any, variant: Variant) -> object:
        loaded.append(variant)
        return object()

    monkeypatch.setattr(ModelCache, "_load", load)
    golden: Any = SimpleNamespace(
        path=Path("golden/sets/tiny"),
        reference=SimpleNamespace(attn_implementation="eager"),
        manifest=SimpleNamespace(dtype_limits={}),  # no dtype the reference cannot run in
    )
    cache = ModelCache()
    base = Variant.from_settings(Settings(), device="cpu", dtype="float32")
    model = cache.get(golden, base)
    assert cache.get(golden, base.with_changes(cache="static")) is model
    assert cache.get(golden, base.with_changes(attention="eager")) is model
    assert loaded == [base.with_changes(attention="eager")]
    others = [
        base.with_changes(compile=CompileSpec("aot_eager")),
        base.with_changes(dtype="bfloat16"),
        base.with_changes(swaps=("rms_norm=fused",)),
        base.with_changes(attention="sdpa"),
    ]
    assert len({id(cache.get(golden, v)) for v in others} | {id(model)}) == 5
    assert len(loaded) == 5
