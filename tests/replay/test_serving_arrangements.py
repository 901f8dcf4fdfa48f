"""The serving arrangements' own rules, without an engine: what each must be seen doing, and
the message of one that was not (the engine skips its tests with it). Serving them through
vLLM is tests/replay/test_vllm_serving.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from numalign.replay.engines.vllm_serving import KV_BLOCK, Exercised
from numalign.runtime.serving import ARRANGEMENTS, DEFAULT_SERVING


def _step(scheduled: dict[str, int], new: list[tuple[str, int, int]] = (),
          resumed: set[str] = frozenset(),
          drafts: dict[str, list[int]] | None = None) -> SimpleNamespace:  # fmt: skip
    """A scheduler output as vLLM's runner receives it: tokens scheduled per request, the new
    requests (id, prompt length, tokens already computed: a prefix hit) and those resumed."""
    return SimpleNamespace(
        num_scheduled_tokens=scheduled,
        scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=[0] * n,
                                            num_computed_tokens=c) for r, n, c in new],
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)),
        scheduled_spec_decode_tokens=drafts or {},
    )  # fmt: skip


def test_what_the_scheduler_did_is_counted() -> None:
    seen = Exercised()
    # a 40-token prompt: 32 of it from the prefix cache, the other 8 in one step; a 24-token
    # prompt cut at 16 (chunked); then a step that resumes a preempted row
    seen.saw(_step({"a": 8, "b": 16}, new=[("a", 40, 32), ("b", 24, 0)]))
    seen.saw(_step({"b": 8, "c": 1}, resumed={"c"}))
    seen.saw(_step({"a": 4}, drafts={"a": [7, 8, 9]}))  # a verification of three drafts
    assert (seen.steps, seen.most_rows, seen.chunked_prompts) == (3, 2, 1)
    assert (seen.prefix_hit_tokens, seen.preemptions, seen.drafted_tokens) == (32, 1, 3)


@pytest.mark.parametrize(
    "name", ["prefix-cached", "preempted", "chunked-8", "crowded", "speculative"]
)
def test_an_arrangement_not_exercised_says_what_the_set_lacks(name: str) -> None:
    arrangement = ARRANGEMENTS[name]
    idle = Exercised(steps=3, most_rows=2)
    rows = [8, 6] if name == "chunked-8" else [24, 18]
    reason = idle.unexercised(arrangement, "tiny-x", rows)
    assert reason is not None
    if name == "crowded":
        assert "at most 2 rows in one step, not the 64" in reason
    elif name == "chunked-8":
        assert "at most 8 tokens, within one step's budget of 8" in reason
    elif name == "speculative":
        assert "verified no drafted token" in reason and "no decode steps" in reason
    else:
        # rows past two KV blocks: what the prefix cache and preemption need to be seen
        assert "rows have at most 24 tokens" in reason
        assert f"--long {2 * KV_BLOCK + KV_BLOCK // 4}" in reason


def test_arrangements_that_promise_nothing_are_never_unexercised() -> None:
    for name in (DEFAULT_SERVING, "alone", "unchunked", "prefill-scored"):
        assert Exercised().unexercised(ARRANGEMENTS[name], "tiny-x", [24]) is None
    busy = Exercised(steps=9, most_rows=64, chunked_prompts=3, prefix_hit_tokens=64,
                     preemptions=2, drafted_tokens=12)  # fmt: skip
    assert all(busy.unexercised(a, "tiny-x", [72]) is None for a in ARRANGEMENTS.values())
