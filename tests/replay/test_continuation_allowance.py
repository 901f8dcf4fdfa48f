"""The greedy continuation's near-tie allowance: a flip of the greedy token at a position after
the prompt is explained by the larger of the prompt's logits budget and the budget the set's
decode calibration gives positions after the prompt (bfloat16 errs there many times more than
in the prompt: a tiny flex_olmo checkpoint's logits 0.18 in the prompt and 3.1 in decode,
whose honest continuation failed on the prompt's budget alone)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from numalign.compare.logits import near_tie
from numalign.compare.model_judge import continuation_agreement
from numalign.golden.store import GoldenSet
from numalign.replay.model import greedy_steps

SET = Path(__file__).resolve().parents[2] / "golden" / "sets" / "tiny-llama"
REQUEST = "text-leftpad"
#: The step whose greedy token the stand-in model flips (after the prompt, before the end).
FLIP_STEP = 3


class _Replayed(torch.nn.Module):
    """Returns the golden continuation's logits at each step, except that at ``FLIP_STEP`` the
    runner-up token of the first row is lifted just above the golden token: a flip whose gap is
    that row's golden gap between the two."""

    def __init__(self, golden: GoldenSet, prompt: int) -> None:
        super().__init__()
        continuation = golden.continuation(REQUEST)
        assert continuation is not None
        self.logits = golden.tensor(continuation.logits).float()
        self.prompt = prompt

    def gap(self) -> float:
        row = self.logits[0, FLIP_STEP]
        top2 = row.topk(2).values
        return float(top2[0] - top2[1])

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        step = input_ids.shape[1] - self.prompt
        logits = self.logits[:, step].clone()
        if step == FLIP_STEP:
            second = logits[0].topk(2).indices[1]
            logits[0, second] = logits[0].max() + 1.0
        return SimpleNamespace(logits=logits[:, None])


def _agreement(prompt_budget: float, later: float) -> Any:
    golden = GoldenSet.open(SET)
    continuation = golden.continuation(REQUEST)
    assert continuation is not None
    inputs = {k: golden.tensor(v) for k, v in golden.request(REQUEST).inputs.items()}
    model = _Replayed(golden, inputs["input_ids"].shape[1])
    tokens = golden.tensor(continuation.tokens)
    steps = greedy_steps(model, inputs, tokens)
    result = continuation_agreement(REQUEST, steps, tokens, golden.tensor(continuation.logits),
                                    prompt_budget, lambda actual, expected: later)  # fmt: skip
    return model, result


def test_a_flip_beyond_the_prompt_budget_is_explained_by_the_later_positions_budget() -> None:
    model, _ = _agreement(0.0, 0.0)
    gap = model.gap()
    # a prompt budget whose near tie is a tenth of the gap: the prompt alone cannot explain it
    prompt_budget = 0.1 * gap / near_tie(1.0)
    _, alone = _agreement(prompt_budget, 0.0)
    assert alone.first_divergence == FLIP_STEP and not alone.passed
    # a decode calibration whose near tie is twice the gap explains it
    _, explained = _agreement(prompt_budget, 2.0 * gap / near_tie(1.0))
    assert explained.first_divergence == FLIP_STEP and explained.passed
    assert explained.near_tie == near_tie(2.0 * gap / near_tie(1.0))


def test_the_later_budget_never_lowers_the_prompt_budget() -> None:
    model, _ = _agreement(0.0, 0.0)
    prompt_budget = 2.0 * model.gap() / near_tie(1.0)  # explains the flip by itself
    _, result = _agreement(prompt_budget, 0.0)  # a set without a decode calibration
    assert result.passed and result.near_tie == near_tie(prompt_budget)
