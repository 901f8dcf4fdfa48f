"""The honest kernels of the newest families (``honest_kernels.py``: int4 dequantization in
the one-rounding affine form, the int4 GEMM with its zero point folded out, attention sinks
through exp2 with a float32 log2(e), and with the softmax scale and log2(e) folded into one
float32 constant) pass on the committed seeds and on inputs drawn again.

Before the budget's accumulation allowance took the accumulator's relative spacing (not the
ulp at the largest output, which halves for a draw just below a power of two) and
``int4_dequant`` its second rounding, the dequantization failed float32 relative L2 on the
outlier groups on 5 of 5 redrawn seeds (1.03 to 1.10) and the folded GEMM max abs on 1 of 5
(1.25). Before the systematic scale's floor took in the exponent's reach, the folded-constant
sinks kernel failed it on 1 of 6 draws of the sink-dominant case (8.4 float32 roundoffs, past
the floor of sqrt(40)).
"""

from __future__ import annotations

import dataclasses
import os

import honest_kernels
import pytest
import torch

from numalign.ops.check import check_operator
from numalign.ops.registry import OPERATORS, candidates

#: At least 5 redrawn seeds (the report's count), more where the nightly asks for more.
SEEDS = range(0, max(5, int(os.environ.get("NUMALIGN_RESEEDS", "5"))) + 1)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNELS = {
    "int4_dequant": "honest_int4_affine_fma",
    "int4_gemm": "honest_int4_folded_zero",
    "attention_sinks": "honest_sink_exp2",
    "attention_sinks/folded": "honest_sink_exp2_folded",
}
#: Where the failures were: the full grid below tier nightly for the outlier case and the
#: smoke cases, every seed (the other pr cases cost minutes for no failure ever seen).
FOCUS = ("outliers-", "sink-dominant-", "large-")


@pytest.mark.parametrize("operator", sorted(KERNELS))
def test_honest_kernels_of_the_newest_families_pass_on_redrawn_inputs(operator: str) -> None:
    # the kernel's log2(e) is the float32 one, not the float64 one: its rounding is the test
    assert float.fromhex("0x1.71547652b82fep+0") != honest_kernels.LOG2E_F32
    op = OPERATORS[operator.split("/")[0]]
    cand = candidates(op.name)[KERNELS[operator]]
    failures, judged = [], 0
    for case in op.cases:
        if not (case.runs_at("smoke") or case.name.startswith(FOCUS)) or case.tier == "nightly":
            continue
        for seed in SEEDS:
            name = f"{case.name}@reseed{seed}" if seed else case.name
            drawn = dataclasses.replace(case, name=name)
            for dtype in DTYPES:
                for result in check_operator(op, cand, drawn, dtype, torch.device("cpu")):
                    judged += 1
                    if not result.passed:
                        failures.append(f"{drawn.name} {dtype}: {result.message()}")
    assert judged, "no case judged"
    assert not failures, "\n\n".join(failures)
