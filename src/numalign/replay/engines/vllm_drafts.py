"""The draft proposer of the speculative serving arrangement: vLLM loads it by its path
(``speculative_config={"method": "custom_class", "model": GOLDEN_DRAFTS}``) and asks it for
each row's drafts after every step; it proposes the row's next golden decode tokens, so that
vLLM's verification forward computes the decode steps the set recorded and their logits are
judged against the golden ones. A user-written class, as vLLM's own proposers are not: its
n-gram proposer imports numba, after which vLLM 0.32's CPU build fails to start any further
engine in the process (its kernel registration scans llvmlite's library object)."""

from __future__ import annotations

from typing import Any

#: The path vLLM imports the proposer by.
GOLDEN_DRAFTS = f"{__name__}.GoldenDrafts"

#: Where a row's golden tokens travel in its sampling parameters (``vllm_serving``'s).
FORCED_KEY = "numalign_forced"


class GoldenDrafts:
    """Proposes each row's next golden tokens (as many as vLLM asks for, after those the row
    generated so far); the engine hands it the model runner (``runner``), whose batch says
    which request each row is."""

    def __init__(self, vllm_config: Any) -> None:
        self.count = int(vllm_config.speculative_config.num_speculative_tokens)
        self.runner: Any = None

    def propose(
        self, sampled: list[list[int]], lengths: Any, *args: Any, **kwargs: Any
    ) -> list[list[int]]:
        if self.runner is None:  # not serving a golden set (vLLM's own warm-up)
            return [[] for _ in sampled]
        drafts = []
        for i, rid in enumerate(self.runner.input_batch.req_ids[: len(sampled)]):
            request = self.runner.requests[rid]
            golden = (request.sampling_params.extra_args or {}).get(FORCED_KEY) or []
            made = int(lengths[i]) - len(request.prompt_token_ids)
            drafts.append(list(golden[made : made + self.count]) if sampled[i] else [])
        return drafts

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the drafts are the golden tokens."""
