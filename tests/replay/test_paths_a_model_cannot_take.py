"""Paths a model cannot take are detected from the model and skipped with the reason, never a
crash: layer types transformers' paged cache does not hold, a config that holds head_dim per
layer, a model with a cache class of its own (capture and decode use it, read as it holds
its states where it has no ``layers``; other caches skip), a model whose code asks the paged
cache for what it lacks (BART's decoder), a model whose code cannot decode with a static
cache (BLOOM: the reference's limit found at capture) or whose static cache transformers
cannot build (DeepSeek-V4), and a module that needs state the model shares between layers
(its layer replay skips)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from numalign.golden.capture import capture
from numalign.golden.capture_spec import CaptureSpec
from numalign.golden.manifest import CACHE_POINT
from numalign.golden.reference import CacheUnsupported, load_model, new_cache
from numalign.golden.store import GoldenSet
from numalign.replay.decode import run_decode
from numalign.replay.layer import AloneUnsupported, replay_call, shared_inputs, within_range
from numalign.replay.paged import (
    PAGED_ATTENTION,
    PagedUnsupported,
    paged_layer_types,
    paged_unsupported,
    replay_paged_requests,
)
from numalign.sweep.build import build_tiny, tiny_config


def _tiny(model_type: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config(model_type))


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("falcon_h1", "layers of type hybrid"),
        ("llama4_text", "layers of type chunked_attention"),
        ("qwen3_next", "layers of type linear_attention"),
        ("gemma4_text", "holds head_dim per layer"),
        ("minimax", "builds a cache of its own"),
        # sliding_window without layer_types: the paged cache makes every layer sliding, and
        # Moshi's code applies no window (its paged decode failed 2e4x the budget)
        ("moshi", "and MoshiForCausalLM's code applies no window"),
    ],
)
def test_paged_skips_what_its_cache_does_not_hold(model_type: str, expected: str) -> None:
    reason = paged_unsupported(_tiny(model_type))
    assert reason is not None and expected in reason


def test_paged_serves_the_layer_types_it_holds() -> None:
    assert {"full_attention", "sliding_attention"} <= paged_layer_types()
    assert paged_unsupported(_tiny("llama")) is None
    assert paged_unsupported(_tiny("gemma3_text")) is None  # sliding and full layers
    assert paged_unsupported(_tiny("mistral")) is None  # a window its code applies too


def _captured(model_type: str, tmp_path: Path) -> GoldenSet:
    model_dir = build_tiny(model_type, tmp_path / "models")
    spec = CaptureSpec(decode_steps=2, progress=False)
    return capture(model_dir, tmp_path / "sets" / model_type, spec)


def _decode_errors(golden: GoldenSet, model: Any, request: Any) -> dict[str, float]:
    """The decode replay of ``request`` with a dynamic cache in float32: per point, its
    largest absolute error against the set."""
    worst: dict[str, float] = {}

    def on_pair(request, step, point, path, actual, expected, call=0):  # type: ignore[no-untyped-def]
        diff = float((actual.float() - expected.float()).abs().max())
        worst[point] = max(worst.get(point, 0.0), diff)

    run_decode(golden, model, request, "dynamic", torch.float32, "cpu", on_pair)
    return worst


def test_a_model_with_its_own_cache_captures_and_decodes_with_it(tmp_path: Path) -> None:
    golden = _captured("minimax", tmp_path)
    model = load_model(golden.model_dir, "float32", attn_implementation=None,
                       trust_remote_code=False)  # fmt: skip
    assert new_cache(model, "dynamic", 16) is None  # the prefill builds MiniMaxCache
    with pytest.raises(
        CacheUnsupported, match=r"builds a cache of its own .*: a static cache is not one it takes"
    ):
        new_cache(model, "static", 16)

    worst: dict[str, float] = {}

    def on_pair(request, step, point, path, actual, expected, call=0):  # type: ignore[no-untyped-def]
        diff = float((actual.float() - expected.float()).abs().max())
        worst[point] = max(worst.get(point, 0.0), diff)

    request = golden.decode_requests[0]
    run_decode(golden, model, request, "dynamic", torch.float32, "cpu", on_pair)
    # the cache's states (MiniMax's own cache, read back from the prefill) were compared
    assert CACHE_POINT in worst
    # the same model, dtype and machine as the capture: agreement to float32 reordering
    # (1e-4 absolute on values of order ten; a cache that was dropped or rebuilt differs by
    # the values themselves)
    assert worst and max(worst.values()) < 1e-4


def test_a_model_s_own_cache_without_layers_is_read_as_it_holds_its_states(
    tmp_path: Path,
) -> None:
    """xLSTM builds a cache of its own (``xLSTMCache``) that has no ``layers``: its recurrent
    states are a dict by layer of (C, n, m) tensors, and capture crashed reading the cache
    after the prefill (``'xLSTMCache' object has no attribute 'layers'``). Such a cache is
    read as it holds its states, by attribute path (``rnn_state.L.J``): the recorded final
    states are the ones xLSTM's own forward of the whole sequence leaves, and the decode
    replay compares them."""
    golden = _captured("xlstm", tmp_path)
    model = load_model(golden.model_dir, "float32", attn_implementation=None,
                       trust_remote_code=False)  # fmt: skip
    assert new_cache(model, "dynamic", 16) is None  # the prefill builds xLSTMCache
    if not golden.decode_requests:
        import transformers
        from packaging.version import Version

        # transformers 5.19 (vLLM's pin): capture records no decode request for xLSTM there
        # (seen in vLLM's environment; the cache without layers is met on 5.24)
        assert Version(transformers.__version__) < Version("5.24")
        pytest.skip(f"transformers {transformers.__version__}'s xLSTM records no decode")
    request = golden.decode_requests[0]
    decode = golden.decode(request)
    assert decode is not None and len(decode.steps) == 2
    layers, states = model.config.num_hidden_layers, 3  # C, n and m per layer
    names = {f"rnn_state.{layer}.{j}" for layer in range(layers) for j in range(states)}
    assert set(decode.prefill_cache) == set(decode.final_cache) == names

    ids = golden.tensor(golden.request(request).inputs["input_ids"])
    tokens = [golden.tensor(step.token) for step in decode.steps]
    with torch.no_grad():
        whole = model(input_ids=torch.cat([ids, *tokens], dim=1), use_cache=True).cache
    for layer in range(layers):
        for j in range(states):
            name = f"rnn_state.{layer}.{j}"
            expected = whole.rnn_state[layer][j]
            apart = (golden.tensor(decode.final_cache[name]) - expected).abs().max()
            # its forward over the whole sequence against its prefill and two steps, the
            # same function summed in another order: float32 reordering at most (6e-7 of the
            # largest state measured, 1e-5 allowed; a state read before the steps moved it
            # is off by the state itself)
            assert apart <= 1e-5 * expected.abs().max()

    worst = _decode_errors(golden, model, request)
    assert CACHE_POINT in worst and len(worst) > 2  # cache states, logits and layers compared
    # the capture's model, dtype, cache and machine: the same sums (0 apart measured); 1e-4
    # leaves float32 reordering on values of order ten
    assert max(worst.values()) < 1e-4


def test_a_model_calling_what_the_paged_cache_lacks_skips_with_the_reason(
    tmp_path: Path,
) -> None:
    """BART's decoder (``BartForCausalLM``) in transformers 5.24 asks
    ``past_key_values.get_seq_length()``, which transformers' paged cache has not: the paged
    replay skips, naming the call, instead of failing as if the engine had erred (the day-0
    sweep met it as two crashes). Older transformers (5.19, vLLM's pin) do not ask, and the
    paged engine serves BART there."""
    import transformers
    from packaging.version import Version

    golden = _captured("bart", tmp_path)
    model = load_model(golden.model_dir, "float32", attn_implementation=PAGED_ATTENTION,
                       trust_remote_code=False)  # fmt: skip
    assert paged_unsupported(model) is None  # its layer types are ones the cache holds
    asks = Version(transformers.__version__) >= Version("5.24")
    try:
        served = replay_paged_requests(golden, model, "cpu", lambda *args, **kwargs: None)
    except PagedUnsupported as exc:
        assert "calls get_seq_length on transformers' paged cache" in str(exc)
    else:
        assert not asks, "transformers 5.24's BART asks the paged cache for get_seq_length"
        assert served  # every golden request it could serve


def test_a_model_that_drops_the_paged_batch_arguments_skips_with_the_reason(
    tmp_path: Path,
) -> None:
    """StableLM's layers do not pass the engine's per-batch arguments on to the paged cache
    (its decoder layer drops ``**kwargs``): transformers 5.24's paged cache then fails with
    ``KeyError: 'cu_seq_lens_k'``; GPT-Neo's attention calls the cache's update without
    them. The paged replay skips, naming it, instead of failing as if the engine had erred
    (the sweep met each as two crashes)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.24"):
        # transformers 5.19's paged engine fails StableLM with another error (in SDPA: "The
        # size of tensor a (32) must match the size of tensor b (64)"), not classified yet
        pytest.skip("StableLM's paged replay is classified on transformers 5.24 and later")
    # StableLM drops them on the way (KeyError); GPT-Neo calls the cache's update without them
    # (GPT-Neo has no SDPA path: the engine runs its eager kernel, as the suites do)
    for model_type, said, attn in (("stablelm", "'cu_seq_lens_k'", PAGED_ATTENTION),
                                   ("gpt_neo", "'kwargs'", "eager")):  # fmt: skip
        golden = _captured(model_type, tmp_path)
        model = load_model(golden.model_dir, "float32", attn_implementation=attn,
                           trust_remote_code=False)  # fmt: skip
        with pytest.raises(PagedUnsupported, match="do not pass the paged engine's batch") as exc:
            replay_paged_requests(golden, model, "cpu", lambda *args, **kwargs: None)
        assert said in str(exc.value)


def test_transformers_code_failing_on_the_paged_path_skips_with_the_reason(
    tmp_path: Path,
) -> None:
    """A code-path error (AttributeError, KeyError, TypeError) raised in transformers' code
    for the model while the paged engine serves it is a path the model cannot take: MPT calls
    ``.to(torch.bool)`` on the causal mask, which the paged path leaves None; MiMo-V2-Flash's
    layers without attention sinks hold ``sinks = None``, which the eager paged attention
    reshapes. Both skip naming the line, instead of failing as if the engine had erred (the
    sweep met each as two false alarms). A kernel's error (RuntimeError) still fails."""
    import transformers
    from packaging.version import Version

    from numalign.replay.paged import _in_model_code

    fails = Version(transformers.__version__) >= Version("5.24")
    for model_type, where, attn in (("mpt", "mpt/modeling_mpt.py", "eager"),
                                    ("mimo_v2_flash", "integrations/eager_paged.py",
                                     "eager")):  # fmt: skip
        golden = _captured(model_type, tmp_path)
        model = load_model(golden.model_dir, "float32", attn_implementation=attn,
                           trust_remote_code=False)  # fmt: skip
        try:
            served = replay_paged_requests(golden, model, "cpu", lambda *args, **kwargs: None)
        except PagedUnsupported as exc:
            assert "fails on the paged path, at " in str(exc) and where in str(exc)
        else:  # transformers 5.19 (vLLM's pin) builds the mask and serves both
            assert not fails, f"transformers {transformers.__version__}'s {model_type} failed"
            assert served
    from transformers.models.mpt import modeling_mpt

    def raised_in_mpt(kind: str) -> BaseException:  # an error whose frame is MPT's file
        try:
            exec(compile(f"raise {kind}('x')", modeling_mpt.__file__, "exec"))
        except Exception as exc:
            return exc
        raise AssertionError("nothing raised")

    assert _in_model_code([raised_in_mpt("AttributeError")]) is not None  # a code path
    assert _in_model_code([raised_in_mpt("RuntimeError")]) is None  # a kernel's: a failure


def test_a_static_cache_the_reference_cannot_decode_with_skips_with_the_reason(
    tmp_path: Path,
) -> None:
    """BLOOM builds its ALiBi bias from the 2D mask it is given, as long as the input, not as
    the static cache: its own forward fails on a padded request with a static cache (the
    day-0 sweep met it as two crashes). Capture tries it on the reference and writes the
    limit into the set; the decode replay with a static cache then skips that request with
    the reference's message, while the dynamic cache still replays."""
    golden = _captured("bloom", tmp_path)
    limited = {name: d.cache_limits for name, d in golden.manifest.decode.items()
               if d.cache_limits}  # fmt: skip
    assert limited, "the reference's static decode of a padded BLOOM request fails"
    assert all(set(v) == {"static"} and "RuntimeError" in v["static"] for v in limited.values())
    model = load_model(golden.model_dir, "float32", attn_implementation=None,
                       trust_remote_code=False)  # fmt: skip
    request = next(iter(limited))
    for implementation in ("static", "offloaded_static"):  # both share the static limits
        with pytest.raises(CacheUnsupported, match="reference itself could not decode"):
            run_decode(golden, model, request, implementation, torch.float32, "cpu",
                       lambda *args, **kwargs: None)  # fmt: skip
    pairs: list[str] = []
    run_decode(golden, model, request, "dynamic", torch.float32, "cpu",
               lambda request, step, point, *rest, **kwargs: pairs.append(point))  # fmt: skip
    assert CACHE_POINT in pairs  # the dynamic decode replays the same request to its end


def test_a_static_cache_that_computes_another_result_is_a_limit_too(tmp_path: Path) -> None:
    """GIT's static-cache decode runs but computes another result than its dynamic one (its
    encoder layers 2% off in the sweep, a false alarm of the device): capture compares the
    reference's step logits under both caches and records the disagreement as a limit."""
    golden = _captured("git", tmp_path)
    limits = [d.cache_limits.get("static", "") for d in golden.manifest.decode.values()]
    assert limits and all("differ from the dynamic cache's by" in text for text in limits)


def test_a_static_cache_transformers_cannot_build_for_the_model_skips_with_the_reason(
    tmp_path: Path,
) -> None:
    """DeepSeek-V4's compressed attention layers (``heavily_compressed_attention``) have no
    static-cache layer class in transformers: building the static cache for its config
    raises (a KeyError), which capture crashed on. The failure is the reference's limit like
    any other of that path, recorded with its message; the static decode replay skips, and
    the dynamic one, with the model's own layer types, replays."""
    golden = _captured("deepseek_v4", tmp_path)
    decodes = golden.manifest.decode
    assert decodes and all(
        set(d.cache_limits) == {"static"}
        and "heavily_compressed_attention" in d.cache_limits["static"]
        for d in decodes.values()
    )
    model = load_model(golden.model_dir, "float32", attn_implementation=None,
                       trust_remote_code=False)  # fmt: skip
    request = next(iter(decodes))
    with pytest.raises(CacheUnsupported, match="heavily_compressed_attention"):
        run_decode(golden, model, request, "static", torch.float32, "cpu",
                   lambda *args, **kwargs: None)  # fmt: skip
    pairs: list[str] = []
    run_decode(golden, model, request, "dynamic", torch.float32, "cpu",
               lambda request, step, point, *rest, **kwargs: pairs.append(point))  # fmt: skip
    assert CACHE_POINT in pairs


def test_a_dtype_the_reference_cannot_run_in_skips_with_the_reason(tmp_path: Path) -> None:
    """XLNet's own code cannot run in bfloat16: its relative positional tables are built in
    float32 and meet bfloat16 weights (``expected scalar type Float but found BFloat16``),
    which crashed its calibration. Calibration, once it fails, asks whether the model's own
    forward fails in the dtype too; it does, so the set records the limit with the message
    and no calibration of the dtype, and replay in it skips with the reason. A member in a
    subprocess hands its limit back the same way."""
    from numalign.compare.model_verdict import ReplayUnsupported
    from numalign.replay.calibrate import own_failure
    from numalign.replay.decode import DecodeUnavailable, require_decode_replayable
    from numalign.replay.ensemble import Member, capture_calibrated
    from numalign.replay.model import check_dtype

    model_dir = build_tiny("xlnet", tmp_path / "models")
    # one member, in a subprocess (its environment set): its limit comes back through JSON
    members = [Member("apart", env={"NUMALIGN_MEMBER": "apart"})]
    spec = CaptureSpec(continuation=0, long=0, far=0, progress=False)
    golden = capture_calibrated(model_dir, tmp_path / "sets" / "xlnet", spec,
                                calibrate=("float32", "bfloat16"), members=members)  # fmt: skip
    golden = GoldenSet.open(golden.path)  # as written
    limits = golden.manifest.dtype_limits
    assert set(limits) == {"bfloat16"}
    assert "expected scalar type Float but found BFloat16" in limits["bfloat16"]
    assert "(calibration member apart: NUMALIGN_MEMBER=apart" in limits["bfloat16"]
    assert "float32" in golden.manifest.calibration  # the member calibrated it
    assert "bfloat16" not in golden.manifest.calibration
    with pytest.raises(ReplayUnsupported, match="could not run in bfloat16 at capture"):
        check_dtype(golden, "bfloat16")
    check_dtype(golden, "float32")  # replays as before
    # no decode of its own (XLNet takes no cache): the reason it has none stands first
    with pytest.raises(DecodeUnavailable):
        require_decode_replayable(golden, "bfloat16")
    for dtype, fails in (("float32", False), ("bfloat16", True)):
        model = load_model(golden.model_dir, dtype, attn_implementation=None,
                           trust_remote_code=False)  # fmt: skip
        assert (own_failure(golden, model, "cpu", model.dtype) is not None) is fails


def test_a_model_whose_steps_see_the_whole_sequence_decodes_with_its_cache(
    tmp_path: Path,
) -> None:
    """CpmAnt's forward slices off what its cache holds itself, so its generation feeds each
    step the whole sequence (its ``prepare_inputs_for_generation``); fed the new token alone,
    it prepended its prompt again and its position bias no longer matched (the sweep's
    capture crashed: ``size of tensor a (48) must match ... (33)``). The decode now feeds
    what the model's generation asks for: the captured decode gives the logits transformers'
    own cached ``generate`` gives, and the decode replay, whose cache also holds the model's
    own prompt positions before the input's, reproduces the golden one. (CpmAnt's cached
    generation is not its uncached one: 0.1 apart on the logits at the second step in
    transformers 5.24, in its own code; the decode is compared with the cached one.)"""
    from numalign.golden.reference import steps_see_whole_sequence

    assert not steps_see_whole_sequence(_tiny("llama"))  # the usual step: the new token
    model_dir = build_tiny("cpmant", tmp_path / "models")
    spec = CaptureSpec(continuation=3, decode_steps=2, long=0, far=0, progress=False)
    golden = capture(model_dir, tmp_path / "sets" / "cpmant", spec)
    model = load_model(golden.model_dir, "float32", attn_implementation=None,
                       trust_remote_code=False)  # fmt: skip
    assert steps_see_whole_sequence(model)
    request = golden.decode_requests[0]
    decode = golden.decode(request)
    assert decode is not None and len(decode.steps) == 2
    inputs = {k: golden.tensor(v) for k, v in golden.request(request).inputs.items()}
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=len(decode.steps) + 1,
                                   do_sample=False, use_cache=True, output_logits=True,
                                   return_dict_in_generate=True)  # fmt: skip
    for number, step in enumerate(decode.steps, start=1):
        assert step.points  # the layers' new-token outputs were recorded
        # the same model, dtype and cache as generate's: float32 reordering at most (1e-4 on
        # logits of order one; a step fed otherwise gives other logits altogether)
        assert (golden.tensor(step.logits) - generated.logits[number]).abs().max() < 1e-4

    worst = _decode_errors(golden, model, request)
    assert CACHE_POINT in worst and len(worst) > 2  # cache states, logits and layers compared
    # the capture's model, dtype and machine: float32 reordering at most (1e-4 as above)
    assert max(worst.values()) < 1e-4


def test_a_model_whose_generation_feeds_more_than_the_sequence_decodes_whole(
    tmp_path: Path,
) -> None:
    """XLM's forward, like CpmAnt's, slices off what its cache holds itself, and its
    generation feeds each step the whole sequence plus a mask token to predict at: ids one
    longer than the sequence, which the check for CpmAnt's (ids as long as the sequence)
    missed. Fed the new token alone with the sequence's mask, XLM's forward failed an
    assertion on the mask's length (the sweep's capture crashed). A step now feeds the whole
    sequence wherever generation asks for it or more (numalign's steps predict from the last
    position, as its prefill does). Built causal, XLM's cached steps then give the logits its
    uncached forward of the whole sequence gives, and the decode replay reproduces them."""
    import json

    from numalign.golden.reference import generation_positions, steps_see_whole_sequence

    model_dir = build_tiny("xlm", tmp_path / "models")
    config = json.loads((model_dir / "config.json").read_text())
    # causal attention: the cached and the uncached forward then compute the same function
    (model_dir / "config.json").write_text(json.dumps(config | {"causal": True}))
    spec = CaptureSpec(continuation=0, decode_steps=2, long=0, far=0, progress=False)
    golden = capture(model_dir, tmp_path / "sets" / "xlm", spec)
    model = load_model(golden.model_dir, "float32", attn_implementation=None,
                       trust_remote_code=False)  # fmt: skip
    assert model.config.causal and steps_see_whole_sequence(model)
    for request in golden.decode_requests:
        decode = golden.decode(request)
        assert decode is not None and len(decode.steps) == 2
        ids = golden.tensor(golden.request(request).inputs["input_ids"])
        mask = golden.tensor(golden.request(request).inputs["attention_mask"])
        for step in decode.steps:
            assert step.points  # the layers' new-token outputs were recorded
            token = golden.tensor(step.token)
            ids, mask = torch.cat([ids, token], dim=1), torch.cat([mask, torch.ones_like(token)], 1)
            with torch.no_grad():
                uncached = model(input_ids=ids, attention_mask=mask,
                                 position_ids=generation_positions(mask)).logits[:, -1]  # fmt: skip
            apart = (golden.tensor(step.logits) - uncached).abs().max() / uncached.abs().max()
            # the same model and dtype, its cache or none: float32 reordering at most (about
            # 1e-6 of the largest logit; a step fed otherwise gives other logits altogether)
            assert apart < 1e-5

    worst: dict[str, float] = {}

    def on_pair(request, step, point, path, actual, expected, call=0):  # type: ignore[no-untyped-def]
        diff = float((actual.float() - expected.float()).abs().max())
        worst[point] = max(worst.get(point, 0.0), diff)

    run_decode(golden, model, golden.decode_requests[0], "dynamic", torch.float32, "cpu", on_pair)
    assert CACHE_POINT in worst and len(worst) > 2  # cache states, logits and layers compared
    # the capture's model, dtype, cache and machine: the same sums (0 apart measured); 1e-4
    # leaves float32 reordering (about 1e-6 of logits of order 100, as above)
    print("WORST", max(worst.values()))
    assert max(worst.values()) < 1e-4


def test_a_complex_output_is_captured_and_replayed_as_real_numbers(tmp_path: Path) -> None:
    """DeepSeek-V2's rotary embedding returns complex ``freqs_cis``: its calibration crashed
    converting a complex error to a float. Outputs are flattened to their real view ([..., 2]:
    real and imaginary parts), in capture and replay alike, so the point replays alone."""
    golden = _captured("deepseek_v2", tmp_path)
    point = next(p for p in golden.points if p.name.endswith("rotary_emb"))
    call = next(iter(point.calls.values()))[0]
    stored = {path: golden.tensor(key) for path, key in call.outputs.items()}
    assert stored and all(t.is_floating_point() and t.shape[-1] == 2 for t in stored.values())
    model = load_model(golden.model_dir, "float32", attn_implementation=None,
                       trust_remote_code=False)  # fmt: skip
    out = replay_call(model.get_submodule(point.name), golden, call, device="cpu",
                      dtype=torch.float32)  # fmt: skip
    for path, expected in stored.items():
        # the same model, dtype and machine as the capture: float32 reordering at most
        assert float((out[path].float() - expected.float()).abs().max()) < 1e-5


def test_a_model_without_limits_records_none_and_round_trips(tmp_path: Path) -> None:
    """A model that decodes with every cache (llama) records no limits, and its manifest
    writes no ``cache_limits`` or ``dtype_limits`` field: older sets and new ones read the
    same."""
    golden = _captured("llama", tmp_path)
    decodes = golden.manifest.decode.values()
    assert decodes and not any(d.cache_limits for d in decodes)
    assert all("cache_limits" not in d for d in golden.manifest.to_json()["decode"].values())
    assert not golden.manifest.dtype_limits and "dtype_limits" not in golden.manifest.to_json()


def test_an_encoder_built_as_a_causal_lm_is_a_decoder() -> None:
    """BERT-style configs (``is_decoder`` False) built as causal LMs get ``is_decoder=True``,
    as their causal-LM class asks: otherwise the tiny model attends bidirectionally and its
    static-cache decode crashed in the sweep (a mask built for the input). Configs without
    the flag, and encoder-decoders whose causal-LM class sets it itself, are left alone."""
    assert tiny_config("bert").is_decoder is True
    assert tiny_config("roberta").is_decoder is True
    assert not tiny_config("bart").is_decoder  # BartForCausalLM makes its own copy a decoder
    assert "is_decoder" not in tiny_config("llama").to_diff_dict()


def test_a_module_that_needs_shared_state_skips_alone(tmp_path: Path) -> None:
    golden = _captured("gemma4_text", tmp_path)
    model = load_model(golden.model_dir, "float32", attn_implementation=None,
                       trust_remote_code=False)  # fmt: skip
    point = next(p for p in golden.points if p.name.endswith("layers.0"))
    call = next(iter(point.calls.values()))[0]
    # the state and its type as transformers names it (KVSharingDict in 5.24, UserDict in 5.19)
    shared = shared_inputs(call)
    assert set(shared) == {"shared_kv_states"} and shared["shared_kv_states"]
    with pytest.raises(AloneUnsupported, match="cannot run alone: its call took shared_kv_states"):
        replay_call(model.get_submodule(point.name), golden, call, device="cpu",
                    dtype=torch.float32)  # fmt: skip
    # a module without shared inputs runs alone as before
    norm = next(p for p in golden.points if p.name == "model.norm")
    first = next(iter(norm.calls.values()))[0]
    out = replay_call(model.get_submodule(norm.name), golden, first, device="cpu",
                      dtype=torch.float32)  # fmt: skip
    assert set(out) == set(first.outputs)


def test_an_offloaded_cache_on_the_cpu_skips_with_the_reason() -> None:
    model = _tiny("llama")
    with pytest.raises(CacheUnsupported, match="the model is on the CPU, with nothing to offload"):
        new_cache(model, "offloaded", 16)
    assert new_cache(model, "static", 16) is not None


def test_a_golden_mask_keeps_its_finite_minimum_in_a_lower_dtype() -> None:
    minimum = torch.finfo(torch.float32).min
    mask = torch.tensor([0.0, minimum, float("-inf"), float("nan"), 1e5])
    out = within_range(mask, torch.bfloat16)
    assert out[1] == torch.finfo(torch.bfloat16).min  # not -inf, as a plain cast gives
    assert mask.to(torch.bfloat16)[1] == float("-inf")
    assert out[2] == float("-inf") and out[3].isnan()  # what was not finite stays so
    assert within_range(mask, torch.float16)[4] == torch.finfo(torch.float16).max


def test_longcat_flash_layers_replay_in_bfloat16_without_nan(tmp_path: Path) -> None:
    # two attention sublayers per layer: a padding row's NaN (a fully -inf masked softmax)
    # would reach the real rows through the second one's values
    golden = _captured("longcat_flash", tmp_path)
    model = load_model(golden.model_dir, "bfloat16", attn_implementation="eager",
                       trust_remote_code=False)  # fmt: skip
    point = next(p for p in golden.points if p.name == "model.layers.0")
    for calls in point.calls.values():
        for call in calls:
            outputs = replay_call(model.get_submodule(point.name), golden, call, device="cpu",
                                  dtype=torch.bfloat16)  # fmt: skip
            assert all(not t.isnan().any() for t in outputs.values())
