"""Bugs where no capture point used to look, planted into transformers (``planted_transformers``)
or swapped in: each is caught at the module where it lives, with the right label, in float32
and bfloat16. The planted bugs replay the zoo's sets in this process (``replays``: the
suites' engine, judge and records, the tests a ``-k`` would select); the swap runs the suites
themselves (pytester, in a subprocess), as a user's ``--swap`` does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from planted_transformers import plant
from replays import replay_records

from numalign.records.drift import read_records

ROOT = Path(__file__).resolve().parents[2]
SUITES = ROOT / "suites" / "models"
HERE = Path(__file__).parent


def run_swapped(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str) -> list:
    """The model suites with the planted candidates (``--swap`` one of them); the records."""
    pytester.makepyfile(planted_candidates=(HERE / "planted_models.py").read_text(encoding="utf-8"))
    path = [str(pytester.path), str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, path)))
    pytester.runpytest_subprocess(
        str(SUITES), "--rootdir", str(ROOT), "-p", "no:cacheprovider", "--candidates",
        "planted_candidates", "--report-dir", str(pytester.path / "reports"), "-q", "--dtype",
        "float32,bfloat16", *args,
    )  # fmt: skip
    return read_records(pytester.path / "reports" / "latest")


def divergences(records: list) -> dict[str, dict]:
    """dtype -> the whole-model replay's first divergence (carried by a point's record, or
    by the logits' when only they fail)."""
    # the test's dtype: a record's own is its output's (a router's routing is float32 in a
    # bfloat16 run)
    return {r.test_dtype: r.first_divergence for r in records if r.first_divergence and
            r.mode in ("accumulated", "logits")}  # fmt: skip


def failed_alone(records: list) -> list:
    """The records of points that failed replayed alone (layer replay)."""
    return [r for r in records if r.mode == "isolated" and r.verdict == "failed"]


@pytest.mark.parametrize(
    ("bug", "model", "point"),
    [("padding_attended", "tiny-llama", "model.create_causal_mask"),
     ("window_one_wider", "tiny-mistral", "model.create_sliding_window_causal_mask")],
)  # fmt: skip
def test_a_mask_the_model_builds_wrong_fails_at_its_mask_point(
    monkeypatch: pytest.MonkeyPatch, bug: str, model: str, point: str
) -> None:
    plant(bug, monkeypatch)
    records = replay_records(model, points=("mask",), model=True)
    found = divergences(records)
    expected = {"point": point, "kind": "local", "request": "text-leftpad"}
    assert found == {"float32": expected, "bfloat16": expected}, found
    # alone, on the golden inputs, the mask is judged exactly: where each position attends
    alone = failed_alone(records)
    assert {(r.point, r.dtype, r.rule) for r in alone} == {
        (point, "float32", "exact"), (point, "bfloat16", "exact")}, alone  # fmt: skip
    # never the far rows: unpadded, and of 8 tokens, no longer than tiny-mistral's window
    assert {r.request for r in alone} <= {"text-leftpad", "text-rightpad", "long-leftpad",
                                          "long-rightpad"}  # fmt: skip


def test_rotary_angles_in_bfloat16_fail_at_the_rotary_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plant("rotary_bfloat16", monkeypatch)
    records = replay_records("tiny-llama", points=("rotary",), model=True, caches=("dynamic",))
    found = divergences(records)
    assert {d: (v["point"], v["kind"]) for d, v in found.items()} == dict.fromkeys(
        ("float32", "bfloat16"), ("model.rotary_emb", "local")
    ), found
    alone = {(r.dtype, r.request) for r in records if r.mode == "isolated" and
             r.point == "model.rotary_emb" and r.verdict == "failed"}  # fmt: skip
    # the far positions (up to 239 of 256) fail alone in both dtypes: the angle's error
    # grows with the position
    assert {("float32", "far-positions"), ("bfloat16", "far-positions")} <= alone, alone
    # and decode: the keys the prefill cached are rotated wrong, the step's cos/sin too
    decoded = {r.dtype for r in records if r.mode == "decode" and r.verdict == "failed" and
               r.point == "model.rotary_emb"}  # fmt: skip
    assert decoded == {"float32", "bfloat16"}, decoded


def test_soft_capping_left_out_fails_at_the_logit_transform(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plant("no_softcap", monkeypatch)
    records = replay_records("tiny-gemma2", points=("logit_transform",), model=True)
    found = divergences(records)
    expected = {"point": "logit_transform", "kind": "local", "request": "text-leftpad"}
    assert found == {"float32": expected, "bfloat16": expected}, found
    # every capture point of the forward passes; only the logits fail, and the transform
    # after the head, replayed alone on the head's golden output
    assert not [r for r in records if r.mode == "accumulated" and r.verdict == "failed"]
    assert {r.dtype for r in records if r.mode == "logits" and r.verdict == "failed"} == {
        "float32", "bfloat16"}  # fmt: skip
    assert {(r.point, r.dtype) for r in failed_alone(records)} == {
        ("logit_transform", "float32"), ("logit_transform", "bfloat16")}  # fmt: skip


def test_a_scale_below_one_bfloat16_rounding_is_caught_at_its_norm(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = run_swapped(
        pytester, monkeypatch, "--swap", "rms_norm=scaled_03pct", "-k",
        "tiny-llama and (test_model or layers.0.input_layernorm)",
    )  # fmt: skip
    alone = [r for r in records if r.dtype == "bfloat16" and r.verdict == "failed" and
             r.mode == "isolated"]  # fmt: skip
    # every element within its budget: only the lean pooled over every call fails, alone
    assert [(r.point, r.request) for r in alone] == [
        ("model.layers.0.input_layernorm", "all requests")
    ], alone
    assert "systematic scale of +0.3" in (alone[0].reason or "")
    # in the whole model every element is within its bfloat16 budget, and the lean is judged
    # there but within its range widened by the honest accumulated error at the norm (a
    # relative L2 error of 0.32% at tiny-llama's first norm, which a 0.3% scale does not
    # exceed); float32's budget catches the norm
    found = divergences(records)
    assert "bfloat16" not in found, found
    assert [
        r.point
        for r in records
        if r.mode == "accumulated"
        and r.dtype == "bfloat16"
        and r.request == "all requests"
        and r.point == "model.layers.0.input_layernorm"
    ]
    assert found["float32"] == {"point": "model.layers.0.input_layernorm", "kind": "local",
                                "request": "text-leftpad"}, found  # fmt: skip


def test_a_decode_divergence_is_located_at_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # an RMSNorm whose 16-bit path errs by 2%: in the paged engine's decode (whose cache is
    # not compared) the norm at step 1 is the first divergence, and run again in float32 on
    # the input it was fed it is beyond its own budget: local
    plant("norm_low_precision_path", monkeypatch)
    records = replay_records("tiny-llama", caches=("paged",))
    found = {r.dtype: r.first_divergence for r in records if r.first_divergence}
    assert "float32" not in found  # the float32 path is right
    assert found["bfloat16"] == {"point": "model.layers.0.input_layernorm", "step": 1,
                                 "request": "text-leftpad", "kind": "decode",
                                 "located": "local"}, found  # fmt: skip


def test_mrope_sections_swapped_fail_at_the_rotary_module_on_image_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plant("mrope_sections_swapped", monkeypatch)
    records = replay_records("tiny-qwen2-vl", points=("rotary",), model=True)
    expected = {"point": "model.language_model.rotary_emb", "kind": "local", "request": "image"}
    assert divergences(records) == {"float32": expected, "bfloat16": expected}
    alone = {(r.dtype, r.request) for r in failed_alone(records)}
    # a text token's three positions agree, so only the image request's tables are wrong
    assert alone == {("float32", "image"), ("bfloat16", "image")}, alone


def test_attention_soft_capping_left_out_fails_at_the_attention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plant("no_attention_softcap", monkeypatch)
    records = replay_records("tiny-gemma2", points=("self_attn",), model=True)
    found = divergences(records)
    assert found["float32"] == {"point": "model.layers.0.self_attn", "kind": "local",
                                "request": "text-leftpad"}, found  # fmt: skip
    failed = {r.point for r in failed_alone(records) if r.dtype == "float32"}
    assert failed == {"model.layers.0.self_attn", "model.layers.0.self_attn.1",
                      "model.layers.1.self_attn", "model.layers.1.self_attn.1"}, failed  # fmt: skip
    # bfloat16: the zoo's Gemma 2 logits span tens (zoo.score_gain), where the cap engages;
    # its omission sharpens every softmax, and the attention's output leans larger (a scale
    # of about +0.2%, a half rounding) where the elements stay within bfloat16's budget: an
    # attention fails alone on its lean, and nothing but an attention does
    leaning = [r for r in failed_alone(records) if r.dtype == "bfloat16"]
    assert leaning, "no attention failed alone in bfloat16"
    assert {r.point for r in leaning} <= {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert all(r.request == "all requests" and "systematic scale of +" in (r.reason or "")
               for r in leaning), leaning  # fmt: skip


def test_an_epsilon_a_port_hard_codes_fails_at_every_norm_on_its_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # RMSNorm built with 1e-5 where the config says 1e-6: on the requests' rows (mean square
    # near one) the output moves by 5e-6, below bfloat16's rounding; on the probe's rows,
    # whose variance is the config's epsilon, by tens of percent
    plant("norm_epsilon_1e5", monkeypatch)
    records = replay_records("tiny-llama", points=("norm",), model=True)
    norms = {"model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
             "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm",
             "model.norm"}  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        probed = {r.point for r in failed_alone(records) if r.dtype == dtype and
                  r.request == "probe"}  # fmt: skip
        assert probed == norms, (dtype, probed)
    # in bfloat16 every element of the requests is within its budget: only the probe fails
    requests = {r.request for r in failed_alone(records) if r.dtype == "bfloat16"}
    assert requests <= {"probe", "all requests"}, requests
    # the whole model in float32: every element within its accumulated budget, but the first
    # norm's output leans (its pooled lean, judged in the model too, resolves the 5e-6 scale
    # the wrong epsilon gives every row), so the first divergence is that norm, local
    assert divergences(records) == {"float32": {
        "point": "model.layers.0.input_layernorm", "kind": "local",
        "request": "all requests"}}  # fmt: skip


def test_exact_gelu_for_the_tanh_form_fails_at_the_activation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the forms differ by at most 4.7e-4 (an eighth of a bfloat16 rounding); in the gating
    # tail the activation's probe feeds (-4 to -1) by up to 10% of the output, all one way
    plant("gelu_exact", monkeypatch)
    records = replay_records("tiny-gemma2", points=("mlp",))
    alone = {(r.dtype, r.point) for r in failed_alone(records)}
    assert ("bfloat16", "model.layers.0.mlp.act_fn") in alone, alone
    # bfloat16 fails at the activation only, on its probe's pooled mean error (an offset of
    # about -0.2% of the output's RMS, some fifty standard errors out)
    assert {p for d, p in alone if d == "bfloat16"} == {"model.layers.0.mlp.act_fn"}, alone
    leaned = [r for r in failed_alone(records) if r.dtype == "bfloat16"]
    assert all("systematic offset of the mean error of -" in (r.reason or "") for r in leaned)
    # float32's budget sees the MLPs on the requests too (4.7e-4 is 40x its budget there)
    assert {("float32", "model.layers.0.mlp.act_fn"), ("float32", "model.layers.0.mlp"),
            ("float32", "model.layers.1.mlp")} <= alone, alone  # fmt: skip


def test_a_linear_attention_state_wrong_across_chunks_fails_on_the_long_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plant("linear_attention_state_decay", monkeypatch)
    records = replay_records(
        "tiny-qwen3-next", points=("linear_attn",), model=True, caches=("dynamic",)
    )
    found = divergences(records)
    expected = {"point": "model.layers.0.linear_attn", "kind": "local", "request": "long-leftpad"}
    assert found["bfloat16"] == expected, found
    # float32 resolves the state's wrong decay as a lean of the point's outputs too: its pooled
    # lean ("all requests", judged in the model) ranks where the point's first result does
    assert found["float32"] in (expected, expected | {"request": "all requests"}), found
    alone = {(r.request, r.point) for r in failed_alone(records) if r.request != "all requests"}
    # the first chunk (64 tokens) is right: only the long requests (3 x 64 + 8 tokens, past
    # three chunks) reach a later chunk, in each linear-attention layer
    assert alone == {(req, f"model.layers.{i}.linear_attn") for req in
                     ("long-leftpad", "long-rightpad") for i in (0, 2)}, alone  # fmt: skip
    # decode reads the prefill's final state, carried wrong too
    decoded = {r.dtype for r in records if r.mode == "decode" and r.verdict == "failed"}
    assert decoded == {"float32", "bfloat16"}, decoded


def test_a_router_softmax_in_bfloat16_fails_at_the_router_in_bfloat16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plant("router_softmax_low_precision", monkeypatch)
    records = replay_records("tiny-mixtral", points=("mlp",), model=True)
    found = divergences(records)
    # the float32 path is right; in bfloat16 each weight rounds once more (0.4% of a weight
    # against the honest router's 0.1%, ``compare.routing``) and near ties choose another
    # expert: the router fails where it computes them (which layer and request first
    # depends on the rounding, so neither is pinned)
    routers = {"model.layers.0.mlp.gate", "model.layers.1.mlp.gate"}
    assert set(found) == {"bfloat16"}, found
    assert found["bfloat16"]["kind"] == "local", found
    assert found["bfloat16"]["point"] in routers, found
    failed = {r.point for r in failed_alone(records)}  # the records name point.output
    assert failed & {f"{router}.routing" for router in routers}, failed
    assert all(r.test_dtype == "bfloat16" for r in failed_alone(records))


def test_a_routing_bias_in_the_combine_weights_fails_at_the_router(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # DeepSeek-V3's router weighs its chosen experts by the bias-corrected scores (the zoo's
    # correction bias: std 0.02, a few percent of a sigmoid score); its routing's weights
    # move by up to 4% against the honest router's 0.05% (float32 inside, in every dtype)
    plant("routing_bias_in_combine", monkeypatch)
    records = replay_records("tiny-deepseek-v3", points=("mlp",), model=True)
    found = divergences(records)
    router = "model.layers.1.mlp.gate"
    assert {dtype: (d["point"], d["kind"]) for dtype, d in found.items()} == {
        "float32": (router, "local"), "bfloat16": (router, "local")}, found  # fmt: skip
    alone = {(r.test_dtype, r.point) for r in failed_alone(records)}
    for dtype in ("float32", "bfloat16"):  # the records name point.output
        assert (dtype, f"{router}.routing") in alone, alone


def test_a_layer_norm_of_the_unbiased_variance_fails_at_the_norm_in_the_whole_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GPT-2's LayerNorm dividing by the unbiased variance: every normalized value is
    # sqrt(63 / 64) of its own (-0.78% at the zoo's 64 channels), within bfloat16's
    # per-element budget; the pooled lean of the first norm, whose upstream error is the
    # embeddings' rounding, resolves it in the whole model (and decode, every step pooled)
    plant("layer_norm_unbiased", monkeypatch)
    records = replay_records("tiny-gpt2", model=True, caches=("dynamic",))
    norm = "transformer.h.0.ln_1"
    assert divergences(records) == {
        "float32": {"point": norm, "kind": "local", "request": "text-leftpad"},
        "bfloat16": {"point": norm, "kind": "local", "request": "all requests"},
    }  # fmt: skip
    bf16 = [r for r in records if r.test_dtype == "bfloat16" and r.verdict == "failed"]
    # every element of the whole model within its bfloat16 budget: the lean alone fails
    assert {r.request for r in bf16 if r.mode == "accumulated"} == {"all requests"}, bf16
    leaned = next(r for r in bf16 if r.mode == "accumulated" and r.point == norm)
    assert "systematic scale of -0.8" in (leaned.reason or ""), leaned.reason
    assert "widened by" in (leaned.reason or ""), leaned.reason
    # decode replay fails on a pooled lean too (which point first: the lm_head's, 3x)
    assert {r.request for r in bf16 if r.mode == "decode"} == {"all requests"}, bf16


def test_a_router_without_its_routed_scaling_fails_at_its_decode_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a set captured with this numalign keeps each router's routing per decode step
    # ([batch, 1, experts]); the zoo's committed tiny-deepseek-v3 set predates it, so the
    # test captures its own (bfloat16 calibrated by the reference alone; float32 borrows it)
    import subprocess
    import sys

    out = tmp_path / "sets" / "tiny-deepseek-v3"
    subprocess.run(
        [sys.executable, "-m", "numalign.cli", "capture", str(ROOT / "golden" / "models" /
         "tiny-deepseek-v3"), "--out", str(out), "--calibrate", "bfloat16", "--calibrate-with",
         "none", "--no-probes", "--far", "0", "--continuation", "0"],
        check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"}, capture_output=True,
    )  # fmt: skip
    plant("routed_scaling_ignored", monkeypatch)
    records = replay_records(out, caches=("dynamic",))
    found = {r.test_dtype: r.first_divergence for r in records if r.first_divergence}
    # every combine weight 1 / 2.5 of its own: the router fails at the first step it runs
    # at, in both dtypes (the MoE block's output alone did not resolve it in bfloat16)
    router = "model.layers.1.mlp.gate.routing"
    for dtype in ("float32", "bfloat16"):
        assert found[dtype]["point"] == router and found[dtype]["step"] == 1, found
    routed = {r.test_dtype for r in records if r.mode == "decode" and r.verdict == "failed"
              and r.point == router and r.step is not None}  # fmt: skip
    assert routed == {"float32", "bfloat16"}, routed
