"""Serving arrangements: the ways a serving engine can be made to serve the same golden
requests, each of which changes the numbers through a different path of the engine (its
batching, chunked prefill, prefix cache, preemption, prefill against decode kernels,
speculative verification).

``--serving`` names them (``all``, or a comma list); the model and decode suites replay each
set once per arrangement, and every record names its arrangement in the engine variant. An
arrangement says what it must exercise: a replay whose engine never did it (no prefix hit,
no preemption, no prompt in chunks) is skipped with what the set lacks, never passed as if
the feature had been judged. Torch-free: the settings validate the names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arrangement:
    """How the golden rows are served; ``None`` fields keep the engine's replay defaults."""

    name: str
    what: str
    #: tokens per engine step (the chunked-prefill budget)
    batch_tokens: int | None = None
    #: rows the engine runs at once (its largest batch)
    rows: int | None = None
    #: each row served by itself, one after another
    alone: bool = False
    #: the golden rows among copies of themselves, up to ``rows`` at once
    crowded: bool = False
    #: the prefix cache on, and every row served twice: cold, then from the cache
    prefix_cached: bool = False
    #: a KV cache this many blocks larger than the longest row needs: rows compete for
    #: blocks, and the scheduler preempts (frees and later recomputes) running rows
    spare_blocks: int | None = None
    #: the golden decode tokens appended to each prompt: every decode step scored as a
    #: prefill position (the prefill kernels against the decode steps the set recorded)
    prefill_scored: bool = False
    #: speculative decoding: a proposer that proposes the golden decode tokens, so that one
    #: verification forward computes every decode step at once (its logits judged against
    #: the recorded steps); the tokens are not forced (vLLM takes no logits processor with
    #: speculative decoding): a row whose own first token differs from the golden one skips
    speculative: bool = False
    #: what the engine must be seen doing (``Exercised``'s field), else the replay skips
    exercises: str | None = None


#: The default: every row together, long prompts prefilled in chunks beside other rows'
#: decode steps (the arrangement numalign's engine replay always served).
DEFAULT_SERVING = "batched"

#: Rows of the crowded arrangement: vLLM's CPU default batch is 256 sequences and a GPU's
#: 1024; 64 already crosses every batch-size bucket a kernel chooses by up to 64 rows, and
#: keeps a CPU replay of the zoo within seconds.
CROWD_ROWS = 64
#: Tokens per step of the crowded and unchunked arrangements: past every prompt the zoo's
#: sets hold together (64 rows of 72 tokens would be 4608; the budget counts scheduled
#: tokens, so a larger prompt set is prefilled over more steps, each prompt still whole).
WHOLE_BUDGET = 8192
#: Tokens per step of the finely chunked arrangement: every prompt of more than 8 tokens is
#: prefilled in several chunks (vLLM asks a budget of at least its batch's rows).
FINE_BUDGET = 8

ARRANGEMENTS: dict[str, Arrangement] = {a.name: a for a in (
    Arrangement(DEFAULT_SERVING, "all rows together, 32 tokens a step: long prompts prefilled "
                "in chunks beside other rows' decode steps"),
    Arrangement("alone", "each row served by itself, nothing batched beside it", alone=True),
    Arrangement("crowded", f"the rows among copies of themselves, {CROWD_ROWS} at once, every "
                "prompt in one step", batch_tokens=WHOLE_BUDGET, rows=CROWD_ROWS, crowded=True,
                exercises="crowd"),
    Arrangement("chunked-8", f"{FINE_BUDGET} tokens a step: every prompt prefilled in chunks",
                batch_tokens=FINE_BUDGET, rows=FINE_BUDGET, exercises="chunked_prompts"),
    Arrangement("unchunked", "a token budget past every prompt: each prefilled in one step",
                batch_tokens=WHOLE_BUDGET),
    Arrangement("prefix-cached", "the prefix cache on, every row served twice: cold, then "
                "its full blocks from the cache", prefix_cached=True,
                exercises="prefix_hit_tokens"),
    Arrangement("preempted", "a KV cache one block larger than the longest row needs: rows "
                "preempted and recomputed", spare_blocks=1, exercises="preemptions"),
    Arrangement("prefill-scored", "the golden decode tokens appended to the prompts: each "
                "decode step scored as a prefill position", prefill_scored=True),
    Arrangement("speculative", "speculative decoding with the golden decode tokens as the "
                "drafts: every decode step verified in one forward", speculative=True,
                exercises="drafted_tokens"),
)}  # fmt: skip


def parse_serving(text: str) -> tuple[str, ...]:
    """``"all"`` -> every arrangement; ``"alone,prefix-cached"`` -> those, in order, each
    once; ValueError naming the unknown ones and the known ones otherwise."""
    names = tuple(dict.fromkeys(p.strip().lower() for p in text.split(",") if p.strip()))
    if names == ("all",):
        return tuple(ARRANGEMENTS)
    unknown = [n for n in names if n not in ARRANGEMENTS]
    if unknown or not names:
        raise ValueError(
            f"--serving: unknown arrangement {', '.join(unknown) or repr(text)}; known: all, "
            f"{', '.join(ARRANGEMENTS)} (a comma-separated list; see docs/vllm.md)"
        )
    return names
