"""The decode suite run for real (pytester, in a subprocess, the model suites as users run
them): a rotary that ignores the cache's position offset and a static cache written one slot
off each fail at the first decode step at layer 0's attention while every prefill test
passes; the dynamic cache, an honest alternative to the broken static one, passes; a model the
paged engine cannot serve is skipped with the reason."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from numalign.records.drift import read_records

ROOT = Path(__file__).resolve().parents[2]
SUITES = ROOT / "suites" / "models"

#: A decode kernel's bug: the new token rotated as position 0 (the cache's offset ignored);
#: a prefill (more than one query token) is rotated right.
ROTARY_AT_ZERO = """
import torch
from transformers.models.llama import modeling_llama

original = modeling_llama.LlamaRotaryEmbedding.forward

def forward(self, x, position_ids):
    if x.shape[1] == 1:
        position_ids = torch.zeros_like(position_ids)
    return original(self, x, position_ids)

modeling_llama.LlamaRotaryEmbedding.forward = forward
"""

#: A cache kernel's bug: a decode step's key and value written one slot after the token's
#: (the prefill is written right; the dynamic cache is not touched).
SLOT_OFF = """
from transformers import cache_utils

original = cache_utils.StaticLayer.update

def update(self, key_states, value_states, *args, **kwargs):
    if key_states.shape[-2] != 1 or not self.is_initialized:
        return original(self, key_states, value_states, *args, **kwargs)
    slot = (self.cumulative_length + 1).clamp(max=self.keys.shape[-2] - 1)
    self.keys.index_copy_(2, slot, key_states)
    self.values.index_copy_(2, slot, value_states)
    self.cumulative_length.add_(1)
    return self.keys, self.values

cache_utils.StaticLayer.update = update
"""


def run_suite(pytester: pytest.Pytester, plugin: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(
        **{plugin: {"rotary_at_zero": ROTARY_AT_ZERO, "slot_off": SLOT_OFF}[plugin]}
    )
    return pytester.runpytest_subprocess(
        str(SUITES), "--rootdir", str(ROOT), "-p", "no:cacheprovider", "-p", plugin,
        "--report-dir", str(pytester.path / "reports"), "-q", "--tb=line", "-rfs",
        "--dtype", "bfloat16", "--cache-implementation", "dynamic,static", *args,
    )  # fmt: skip


def failed_tests(result: pytest.RunResult) -> set[str]:
    return set(re.findall(r"FAILED \S+::(test_\w+\[[^\]]+\])", result.stdout.str()))


def decode_divergences(pytester: pytest.Pytester) -> dict[str, dict[str, object]]:
    """test id -> the first divergence its records name."""
    run = next((pytester.path / "reports").iterdir())
    return {
        r.test_id.split("::")[-1]: r.first_divergence
        for r in read_records(run / "records.jsonl")
        if r.first_divergence and r.mode == "decode"
    }


def test_a_rotary_ignoring_the_cache_offset_fails_at_the_first_decode_step(
    pytester: pytest.Pytester, on_path: None
) -> None:
    result = run_suite(pytester, "rotary_at_zero", "-k", "tiny-llama and not deep")
    out = result.stdout.str()
    # every prefill test (each layer alone, the whole model, logits, continuation) passes
    assert failed_tests(result) == {
        "test_decode[tiny-llama-bfloat16-dynamic]",
        "test_decode[tiny-llama-bfloat16-static]",
    }, out[-3000:]
    # the rotary embedding is a capture point: its cos/sin at the decode token are wrong
    # before any attention uses them
    assert "first divergence at decode step 1, model.rotary_emb" in out
    for divergence in decode_divergences(pytester).values():
        assert divergence["step"] == 1 and divergence["point"] == "model.rotary_emb"


def test_a_cache_written_one_slot_off_fails_where_the_honest_cache_passes(
    pytester: pytest.Pytester, on_path: None
) -> None:
    result = run_suite(pytester, "slot_off", "-k", "tiny-llama and not deep")
    out = result.stdout.str()
    # the dynamic cache (the honest alternative) and every prefill test pass
    assert failed_tests(result) == {"test_decode[tiny-llama-bfloat16-static]"}, out[-3000:]
    assert "first divergence at decode step 1, model.layers.0.self_attn" in out
    divergences = decode_divergences(pytester)
    assert divergences["test_decode[tiny-llama-bfloat16-static]"]["step"] == 1
    run = next((pytester.path / "reports").iterdir())
    records = read_records(run / "records.jsonl")
    # the cache's contents after the last step are wrong too, and the records name the cache
    cache = [r for r in records if r.point and r.point.startswith("(cache).layers.0.keys")]
    assert any(r.verdict == "failed" and r.swap == "cache=static" for r in cache)
    assert all(r.verdict == "passed" for r in cache if r.swap == "cache=dynamic")
    # and say what kind of error it is: an entry at one slot, after a decode step
    stale = [r for r in cache if r.verdict == "failed" and (r.step or 0) >= 1]
    assert stale and {(r.cause or {}).get("label") for r in stale} == {"cache"}, [
        r.cause for r in stale
    ]
    # as sure as the labels the docs' confusion table counts as sure (compare/cause.py)
    assert all((r.cause or {}).get("confidence", 0) >= 0.5 for r in stale), [r.cause for r in stale]


def test_models_the_paged_engine_cannot_serve_are_skipped_with_the_reason(
    pytester: pytest.Pytester, on_path: None
) -> None:
    pytester.makepyfile(slot_off="")
    result = pytester.runpytest_subprocess(
        str(SUITES / "test_decode.py"), "--rootdir", str(ROOT), "-p", "no:cacheprovider",
        "--report-dir", str(pytester.path / "reports"), "-q", "-rs", "--dtype", "bfloat16",
        "--cache-implementation", "paged", "-k", "deepseek or qwen3-next or bert",
    )  # fmt: skip
    out = result.stdout.str()
    result.assert_outcomes(skipped=3)
    assert "multi-head latent attention" in out
    assert "has layers of type linear_attention, which transformers' paged cache does not hold" \
        in out  # fmt: skip
    assert "tiny-bert has no decode steps" in out


#: A serving kernel's bug on a soft-capping model: the paged engine's eager attention scales
#: its scores 5% too much, on top of the engine's known soft-capping gap (only the engine
#: runs this kernel; the reference and the signature model do not).
PAGED_SCALE = """
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def scaled(original):
    # attention scores 5% too large in whichever kernel the paged engine runs: "paged|eager"
    # (scaling positional) or, before transformers 5.20, plain "sdpa" (scaling a keyword)
    def forward(module, query, key, value, attention_mask, *args, **kwargs):
        if args:
            args = (args[0] * 1.05, *args[1:])
        else:
            kwargs["scaling"] = (kwargs.get("scaling") or module.scaling) * 1.05
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    return forward


for name in ("paged|eager", "sdpa"):
    AttentionInterface.register(name, scaled(ALL_ATTENTION_FUNCTIONS[name]))
"""


def test_the_paged_soft_capping_gap_is_expected_only_where_its_signature_matches(
    pytester: pytest.Pytester, on_path: None
) -> None:
    def run(plugin: str, source: str) -> pytest.RunResult:
        pytester.makepyfile(**{plugin: source})
        return pytester.runpytest_subprocess(
            str(SUITES / "test_decode.py"), "--rootdir", str(ROOT), "-p", "no:cacheprovider",
            "-p", plugin, "--report-dir", str(pytester.path / f"reports-{plugin}"), "-q", "-rxf",
            "--dtype", "float32", "--cache-implementation", "paged", "-k", "tiny-gemma2",
        )  # fmt: skip

    honest = run("honest_gemma", "")
    # the engine's kernels drop the soft-capping: the errors are the reference's without it
    honest.assert_outcomes(xfailed=1)
    assert "attn_logit_softcapping" in honest.stdout.str()
    broken = run("paged_scale", PAGED_SCALE)
    # the same gap plus a wrong scale in the engine's kernel: not explained, so it fails
    broken.assert_outcomes(failed=1)
