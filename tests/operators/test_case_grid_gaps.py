"""The grid gaps of the operator catalogue, closed, shown by running the
real suite (in a subprocess, as a vendor would) on kernels from outside the repository:

- every grid-gap bug of the catalogue of planted kernels (``planted_kernels.py``) fails on
  the case that closes its gap, in the dtypes named (some bugs hide in one dtype only: that is
  the gap);
- every honest grid-gap kernel there passes in every dtype, at tier pr;
- tier smoke alone catches every wrong kernel of ``test_planted_bug_classes.py`` and every
  planted bug here (the smoke grid holds the unaligned tails, long scans and large regimes).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from suite_runner import run_operator_suite

ALL = ("float32", "bfloat16", "float16")

#: (planted bug, operator) -> (the case that must expose it, the dtypes it must fail in).
GAPS = {
    # soft-capping after the mask: only padding with saturated scores shows it
    ("wrong_softcap_after_mask", "attention"): ("softcap-large-padded-2x4x2x40x40x64", ALL),
    ("wrong_ignores_offset", "rms_norm"): ("gemma-offset-8x4096", ALL),
    ("wrong_ignores_offset", "add_rms_norm"): ("gemma-offset-8x4096", ALL),
    ("wrong_truncates", "quantize_int8"): ("rows-8x4096", ALL),
    ("wrong_truncates", "quantize_fp8"): ("rows-8x4096", ALL),
    # passed with codes compared as integers within 1 of the control's (E4M3 bits, uint8)
    ("wrong_truncates", "fp8_block_quant"): ("act-8x4096", ALL),
    ("wrong_truncates", "kv_quant"): ("fp8-head-2x4x33x64", ALL),
    # passed in bfloat16 with the old bias of thousandths
    ("wrong_bias_in_weights", "moe_routing"): ("dsv3-bias5-9x64-top8-g8", ALL),
    # a float16 accumulator (used for 16-bit inputs only) passed every bfloat16 case
    ("wrong_fp16_accumulator", "matmul"): ("range-1x8x4096x8", ("bfloat16", "float16")),
    # the new operators, one planted bug each (two for the scaled rotary)
    ("wrong_hard_cap", "logit_softcap"): ("large-3x32001", ALL),
    ("wrong_no_max", "log_softmax"): ("large-3x32001", ALL),
    ("wrong_mean_counts_ignored", "cross_entropy"): ("rows-4x32000", ALL),
    ("wrong_topp_before_temperature", "sampling"): ("typical-4x32000-t0.7-k50-p0.9", ALL),
    ("wrong_no_attention_factor", "rope_scaled"): ("yarn-1x4x17x128-at100000", ALL),
    ("wrong_static_ntk", "rope_scaled"): ("dynamic-1x4x17x128-at10000", ALL),
}
#: Honest kernels that differ from the built-ins: (kernel, operator).
RIGHT = (
    ("right_half_away", "quantize_int8"),
    ("right_half_away", "fp8_block_quant"),
    ("right_half_away", "kv_quant"),
    ("right_softcap_first", "attention"),
)
#: Where each truncating quantizer must fail by the rounding rule: (operator, case, point).
TRUNCATED = (
    ("quantize_int8", "rows-8x4096", "quantize_int8.q"),
    ("quantize_fp8", "rows-8x4096", "quantize_fp8.q"),
    ("fp8_block_quant", "act-8x4096", "fp8_block_quant.q"),  # 1x128 groups
    ("fp8_block_quant", "weight-256x384", "fp8_block_quant.q"),  # 128x128 blocks
    ("kv_quant", "fp8-head-2x4x33x64", "kv_quant.codes"),  # E4M3 bits, per head
    ("kv_quant", "int8-token-2x4x33x128", "kv_quant.codes"),  # int8, per token
)


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vendor")


@pytest.fixture(scope="module")
def smoke_run(outside: Path) -> tuple[str, list]:
    """Tier smoke, all dtypes, over the grid-gap kernels and the bug classes of every family
    (``test_planted_bug_classes.py``'s kernels: tier smoke alone must catch them too)."""
    from tests.operators.test_planted_bug_classes import KERNELS

    return run_operator_suite(outside, [*GAPS, *RIGHT, *KERNELS], tier="smoke")


@pytest.fixture(scope="module")
def pr_run(outside: Path) -> tuple[str, list]:
    """Tier pr, all dtypes, over the honest grid-gap kernels."""
    return run_operator_suite(outside, RIGHT, tier="pr")


def _get(record: Any, key: str) -> Any:
    """A field of a drift record, read back as a dict or as a record object."""
    return record[key] if isinstance(record, dict) else getattr(record, key)


def _failed(output: str, name: str, operator: str) -> set[tuple[str, str]]:
    """(dtype, case) pairs of the failed tests of ``name`` on ``operator``."""
    pattern = rf"FAILED \S+::test_{operator}\[{name}-(float32|bfloat16|float16)-([^\]]+)\]"
    return set(re.findall(pattern, output))


@pytest.mark.parametrize(("name", "operator"), sorted(GAPS))
def test_each_planted_bug_fails_on_the_case_that_closes_its_gap(
    smoke_run: tuple[str, list], name: str, operator: str
) -> None:
    output, records = smoke_run
    case, dtypes = GAPS[(name, operator)]
    failed = _failed(output, name, operator)
    missing = [d for d in dtypes if (d, case) not in failed]
    assert not missing, f"{name} passed {operator} {case} in {missing}:\n{output[-3000:]}"
    mine = [r for r in records if _get(r, "candidate") == name and _get(r, "case") == case]
    assert any(_get(r, "verdict") == "failed" for r in mine)


@pytest.mark.parametrize(("operator", "case", "point"), TRUNCATED)
def test_a_truncating_quantizer_fails_by_the_rounding_rule(
    smoke_run: tuple[str, list], operator: str, case: str, point: str
) -> None:
    _, records = smoke_run
    failing = [
        r
        for r in records
        if _get(r, "candidate") == "wrong_truncates"
        and _get(r, "point") == point
        and _get(r, "case") == case
    ]
    assert len(failing) == len(ALL)  # one record of the codes per dtype
    assert all(_get(r, "verdict") == "failed" for r in failing)
    assert {_get(r, "rule") for r in failing} == {"rounding"}
    reasons = [_get(r, "reason") for r in failing]
    assert all("farther neighbour" in reason for reason in reasons), reasons


def test_smoke_catches_every_wrong_external_kernel(smoke_run: tuple[str, list]) -> None:
    from tests.operators.test_planted_bug_classes import WRONG

    output, _ = smoke_run
    escaped = [name for name, (op, _case) in WRONG.items() if not _failed(output, name, op)]
    assert not escaped, f"tier smoke lets through {escaped}"


@pytest.mark.parametrize(("name", "operator"), RIGHT)
def test_each_honest_kernel_passes_in_every_dtype(
    smoke_run: tuple[str, list], pr_run: tuple[str, list], name: str, operator: str
) -> None:
    for output, records in (smoke_run, pr_run):
        assert not _failed(output, name, operator), output[-3000:]
        mine = [r for r in records if _get(r, "candidate") == name]
        ids = " ".join(_get(r, "test_id") for r in mine)
        assert set(re.findall(rf"\[{name}-(\w+?)-", ids)) == set(ALL)
        assert all(_get(r, "verdict") == "passed" for r in mine), [
            (_get(r, "case"), _get(r, "reason")) for r in mine if _get(r, "verdict") != "passed"
        ]
