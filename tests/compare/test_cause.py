"""A cause on every failure (issue 43, ``compare.cause``): each label from a failing case
planted of its kind, honest noise beyond the budget never a confident wrong label, and the
project's planted bug classes never a wrong label with confidence >= 0.5."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from numalign.compare import CompareSpec, compare
from numalign.records.drift import DriftRecord

BF = torch.bfloat16
#: The least confidence a planted case of a label's own kind must get.
BAR = {"scale": 0.9, "offset": 0.9, "clamp": 0.9, "nonfinite": 0.99, "epsilon": 0.8,
       "position": 0.7, "mask": 0.8, "precision": 0.3, "routing": 0.8}  # fmt: skip


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, base: float) -> torch.Tensor:
    d = x.shape[-1]
    angle = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * base ** (
        -torch.arange(0, d, 2, dtype=torch.float64) / d
    )
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(x.dtype) for f in (torch.cos, torch.sin))
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(
        ~keep[:, None, None, :], torch.finfo(q.dtype).min
    )
    return s.softmax(-1) @ v


def _case(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, object]]:
    """(candidate, truth, control, compare's other arguments) of a failing case of ``kind``."""
    x = _x(64, 256)
    if kind == "scale":  # a 1% scale
        return (x * 1.01).to(BF), x, x.to(BF), {}
    if kind == "offset":
        return (x + 0.05).to(BF), x, x.to(BF), {}
    if kind == "clamp":  # a clamp at 2.5
        return x.clamp(-2.5, 2.5).to(BF), x, x.to(BF), {}
    if kind == "nonfinite":
        y = x.clone()
        y[3, 5] = math.nan
        return y.to(BF), x, x.to(BF), {}
    if kind == "epsilon":  # epsilon 1e-3 for 1e-6, rows of mean squares 1e-7 to 10
        rows = (_x(64, 512) * torch.logspace(-3.5, 0.5, 64, dtype=torch.float64)[:, None]).to(BF)
        truth, control = _rms(rows.double(), 1e-6), _rms(rows.float(), 1e-6).to(BF)
        return _rms(rows.float(), 1e-3).to(BF), truth, control, {"op_class": "normalization"}
    if kind == "position":  # rotary with base 9000 for 10000
        q = _x(1, 4, 64, 64).to(BF)
        return _rope(q, 9000.0), _rope(q.double(), 10000.0), _rope(q, 10000.0), {}
    if kind == "mask":  # a padding mask letting one padded key through
        q, k, v = (_x(2, 4, 16, 32, seed=s).to(BF) for s in range(3))
        keep = torch.ones(2, 16, dtype=torch.bool)
        keep[1, :4] = False
        leak = keep.clone()
        leak[1, 3] = True
        truth = _attend(q.double(), k.double(), v.double(), keep)
        return _attend(q, k, v, leak), truth, _attend(q, k, v, keep), {"op_class": "attention"}
    assert kind == "precision"  # a GEMM accumulated in bfloat16, 8 products at a time
    a, b = _x(32, 4096).to(BF), _x(4096, 32, seed=1).to(BF)
    acc = torch.zeros(32, 32, dtype=BF)
    for i in range(0, 4096, 8):
        acc = acc + (a[:, i : i + 8].float() @ b[i : i + 8].float()).to(BF)
    return acc, a.double() @ b.double(), a @ b, {"op_class": "matmul", "reduction_length": 4096}


@pytest.mark.parametrize(
    "kind", ["scale", "offset", "clamp", "nonfinite", "epsilon", "position", "mask", "precision"]
)
def test_a_planted_error_gets_its_label(kind: str) -> None:
    torch.set_num_threads(1)
    actual, truth, control, kwargs = _case(kind)
    result = compare(actual, truth, CompareSpec(control=control, name=kind, **kwargs))  # type: ignore[arg-type]
    assert not result.passed and result.cause is not None
    assert result.cause.label == kind, result.cause
    assert result.cause.confidence >= BAR[kind], result.cause
    assert result.message().splitlines()[-1] == result.cause.line()
    assert result.message().splitlines()[-1].startswith(f"Likely cause: {kind} (confidence ")


def test_a_selection_that_chooses_other_indices_is_routing() -> None:
    scores = _x(8, 100)
    truth = scores.topk(4).indices.sort(-1).values
    wrong = (-scores).topk(4).indices.sort(-1).values
    result = compare(wrong, truth, CompareSpec(ties=scores.float(), op_class="selection"))
    assert not result.passed and result.cause is not None
    assert result.cause.label == "routing" and result.cause.confidence >= BAR["routing"]


def test_a_mask_that_attends_elsewhere_is_mask() -> None:
    truth = torch.ones(4, 8, dtype=torch.bool).tril()
    result = compare(truth.to(torch.int64).roll(1, -1), truth)
    assert not result.passed and result.cause is not None and result.cause.label == "mask"


@pytest.mark.parametrize("times", [4.0, 8.0, 30.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_honest_noise_beyond_the_budget_is_precision_or_unknown(times: float, seed: int) -> None:
    """Noise drawn like the control's rounding, ``times`` as large: failing, and never a
    confident systematic label."""
    x = _x(64, 256, seed=seed)
    control = x.to(BF)
    noise = (control.double() - x)[
        torch.randperm(64, generator=torch.Generator().manual_seed(seed))
    ]
    actual = (x + times * noise).float()
    result = compare(actual, x, CompareSpec(control=control.float()))
    assert not result.passed and result.cause is not None
    assert result.cause.label in {"precision", "unknown"} or result.cause.confidence < 0.5, (
        result.cause
    )


def test_a_pass_has_no_cause_and_the_record_carries_a_failures() -> None:
    x = _x(16, 64)
    assert compare(x.to(BF), x, CompareSpec(control=x.to(BF))).cause is None
    result = compare((x * 1.02).to(BF), x, CompareSpec(control=x.to(BF)))
    record = DriftRecord.from_result(result, test_id="t")
    assert record.cause is not None and record.cause["label"] == "scale"
    back = DriftRecord.from_dict(record.to_json())
    assert back.cause == record.cause and back.schema == 6
    assert DriftRecord.from_dict({"test_id": "t", "schema": 5}).cause is None
    assert result.to_dict()["cause"]["label"] == "scale"


# -- the project's planted bug classes ----------------------------------------------------
#: planted kernel -> the label(s) its failures may get (besides "unknown", always allowed).
EXPECTED: dict[str, set[str]] = {
    "wrong_eps": {"epsilon", "scale"},  # rows of one norm: an epsilon's is a plain scale
    # a bfloat16 sum of squares: rounding noise per row, and a lean (docs: 0.35%)
    "wrong_no_upcast": {"precision", "scale"},
    "wrong_no_max": {"clamp", "nonfinite"},  # exp overflows: the largest values lost
    "wrong_nan_rows": {"nonfinite"},
    "wrong_causal_off_by_one": {"mask"},
    "wrong_gqa_mapping": {"mask"},  # the heads read from the wrong KV head carry it all
    "wrong_interleaved": {"position"},
    "wrong_low_precision_acc": {"precision"},
    "wrong_dropped_tail": {"mask"},  # a term left out of every element: no label fits
    "wrong_no_renorm": {"scale"},  # each token's weights by 1 / their sum
    "wrong_page_offset": {"mask"},  # rows read from the wrong page (a misplaced entry)
    "wrong_chunk_carry": {"mask", "position"},  # positions past a chunk boundary
    "wrong_no_decay_across_chunks": {"mask", "position"},
    # one-pass variance cancels in rows whose mean dwarfs their spread: a per-row scale,
    # confined to those rows
    "wrong_one_pass_variance": {"precision", "scale", "mask"},
    "wrong_window_off_by_one": {"mask"},
    "wrong_smallest": {"routing"},
    "wrong_no_threshold": {"nonfinite", "clamp"},
    "wrong_softcap_after_mask": {"mask"},  # padded keys let through the mask
    "wrong_ignores_offset": {"scale"},  # weight for 1 + weight: a scale per channel
    "wrong_bias_in_weights": {"routing", "scale"},
    "wrong_fp16_accumulator": {"precision", "clamp"},
    "wrong_hard_cap": {"clamp"},
    "wrong_mean_counts_ignored": {"scale"},  # the mean over all tokens: a scale
    "wrong_topp_before_temperature": {"routing", "mask"},  # another nucleus chosen
    "wrong_no_attention_factor": {"scale", "position"},  # a missing attention factor
    "wrong_static_ntk": {"position"},
    "wrong_mla_no_mscale": {"scale"},  # a missing softmax scale
    "wrong_mla_kv_split": set(),  # a layout error: no label fits
    "wrong_sink_kv_head": {"mask"},  # like wrong_gqa_mapping
    "wrong_sink_window_off_by_one": {"mask"},
    "wrong_fp8_weight_scale_n": {"scale", "mask"},  # block scales on the wrong channels
    "wrong_int4_sign_extension": set(),  # a packing error: no label fits
    "wrong_int4_group_128": {"scale"},  # group scales over the wrong groups
    "wrong_kv_scale_gqa": {"mask", "scale"},  # another head's KV scale
}


def test_no_planted_bug_class_gets_a_wrong_label_with_confidence() -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from cause_confusion import causes

    found = causes()
    wrong = [
        f"{kernel} ({operator}, {dtype}, {name}): {label} {confidence:.2f}"
        for (kernel, operator), rows in found.items()
        for dtype, name, label, confidence in rows
        if label not in EXPECTED[kernel] | {"unknown"}
        and confidence >= 0.5
        and not label.startswith("(")
    ]
    assert not wrong, "\n".join(wrong)
    assert set(EXPECTED) == {kernel for kernel, _ in found}


def test_an_error_at_some_cached_positions_after_a_decode_step_is_the_caches() -> None:
    """A cache state's error confined to some positions: after a decode step, an entry
    written stale or into the wrong slot; at the prefill's cache (step 0) or with another
    signature (a scale in every key is its projection's), the label stays."""
    from numalign.compare.cause import Cause, in_cache

    confined = Cause("mask", "the error lies in 2 of 30 rows of dim 0", 0.95)
    found = in_cache(confined, "layers.0.keys", 3)
    assert found is not None and (found.label, found.confidence) == ("cache", 0.95)
    assert "layers.0.keys after decode step 3" in found.evidence
    assert in_cache(confined, "layers.0.keys", 0) == confined
    scaled = Cause("scale", "error = +2% x value", 0.99)
    assert in_cache(scaled, "layers.0.keys", 3) == scaled
    assert in_cache(None, "layers.0.keys", 3) is None
