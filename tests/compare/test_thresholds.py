"""Every threshold is data in compare.tolerances with its reason, and pyproject.toml can
override it: a quantizer's rounding rule per operator, the name-independent thresholds in
``[tool.numalign.thresholds]``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from numalign.compare import load_policy, tolerances
from numalign.compare.budgets import ControlBudget, ToleranceBudget
from numalign.compare.logits import kl_budget, near_tie
from numalign.compare.rounding import ROUND_TO_NEAREST, CodeLayout, RoundingRule, judge_rounding
from numalign.compare.tolerances import Thresholds


def _truncated_int8() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    scale = x.abs().amax(-1, keepdim=True) / 127
    return torch.trunc(x / scale).to(torch.int8), scale, x


def _pyproject(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pyproject.toml"
    path.write_text(text)
    return path


def test_a_pyproject_override_of_the_rounding_rule_takes_effect(tmp_path: Path) -> None:
    q, scale, x = _truncated_int8()
    layout = CodeLayout("int8")
    strict = judge_rounding(q, scale, x, ROUND_TO_NEAREST, layout, name="quantize_int8")
    assert not strict.passed and "farther neighbour" in strict.reason
    policy = load_policy(
        _pyproject(
            tmp_path,
            '[[tool.numalign.override]]\nmatch = "quantize_*"\noff_by_one_share = 0.7\n'
            "bias_limit = 0.6\n",
        )
    )
    loose = judge_rounding(
        q, scale, x, ROUND_TO_NEAREST, layout, name="quantize_int8", policy=policy
    )
    assert loose.passed, loose.reason
    assert loose.budget["off_by_one_share_limit"] == 0.7
    assert loose.budget["bias_limit_steps"] == 0.6
    # the entry's pattern decides: another operator keeps the rule
    other = judge_rounding(q, scale, x, ROUND_TO_NEAREST, layout, name="kv_quant", policy=policy)
    assert not other.passed


def test_the_thresholds_table_overrides_the_logits_constants(tmp_path: Path) -> None:
    policy = load_policy(
        _pyproject(tmp_path, "[tool.numalign.thresholds]\nnear_tie_multiplier = 3\n")
    )
    assert policy.thresholds.near_tie_multiplier == 3.0
    assert near_tie(0.25, policy.thresholds) == 0.75
    assert near_tie(0.25) == 0.5  # the default: twice the max-abs budget
    assert policy.thresholds.kl_spread_power == tolerances.KL_SPREAD_POWER
    # spread 3 squared times the control's KL, half an ulp squared, the float64 evaluation
    assert kl_budget(3.0, 1e-3, 0.0, 1) == pytest.approx(9e-3 + 2.0**-52)
    assert kl_budget(1.0, 0.0, 0.5, 1) == pytest.approx(0.125 + 2.0**-52)


def test_unknown_or_negative_thresholds_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        load_policy(_pyproject(tmp_path, "[tool.numalign.thresholds]\nnear_tie = 3\n"))
    with pytest.raises(ValueError, match=">= 0"):
        load_policy(
            _pyproject(tmp_path, '[[tool.numalign.override]]\nmatch = "q*"\ntie_band = -1.0\n')
        )


def test_the_moved_thresholds_keep_their_values() -> None:
    from numalign.report import baseline

    assert RoundingRule() == RoundingRule(1e-3, 1.5, 1e-3, 0.05)
    assert baseline.NOISE_FLOOR == 0.05
    assert Thresholds() == Thresholds(2.0, 2.0, 0.5, 2.0**-52)
    assert tolerances.SWAP_PROBE_EPS == 4.0


def test_each_rule_states_its_budget_where_it_came_from() -> None:
    from numalign.compare.measure import _control_budget, _table_tolerance
    from numalign.compare.policy import DEFAULT_POLICY
    from numalign.compare.tolerances import Budget

    t = torch.linspace(-1, 1, 64, dtype=torch.float64)
    c = t.to(torch.bfloat16)
    measured = _control_budget(c, t, c, None, 16, "gelu", DEFAULT_POLICY, Budget(8.0, 4.0))
    assert isinstance(measured.budget, ControlBudget)
    assert measured.budget.source == "control, the operator's own multipliers"
    assert measured.budget.max_abs_multiplier == 8.0 and measured.budget.accumulation > 0
    table = _table_tolerance(c, t, None, None, "gelu", "elementwise", DEFAULT_POLICY, None)
    assert table.budget == ToleranceBudget(1.6e-2, 1e-5, None, source="table")
