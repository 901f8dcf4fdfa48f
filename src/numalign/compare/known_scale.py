"""Whether a candidate kernel's known systematic scale explains a failed verdict.

An engine that measured one of its kernels scaling every output (vLLM's CPU fused MoE in
bfloat16 rounding toward zero where the CPU has neither AMX nor AVX512-BF16:
``replay.engines.vllm_kernels``) hands the judge a ``core.kernel_scale.KnownScale``: the
points whose output that kernel produces, the range of the scale over the probe's inputs,
and the evidence. The judge (``compare.judge``) judges those points as they are (their
records keep their verdict) and, where one fails, again with the scale taken out: the
candidate's output divided by each scale of the range (``KnownScale.scales``), re-rounded to
its dtype; a failing pooled lean, pooled again so. The failure is the kernel's where one of
those passes. A verdict whose every failure is so explained is an expected failure
naming the evidence (``Explained.reason``); anything more (a planted bug on top, a failure at
another point, the logits) is not explained and fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from numalign.core.kernel_scale import KnownScale

#: A failing result's key: (point, path, request, step, call).
ResultKey = tuple[str, str, str, "int | None", int]


@dataclass
class Explained:
    """The failures the known scale explains and those it does not, as a judge finds them."""

    known: KnownScale
    explained: set[ResultKey] = field(default_factory=set)
    #: failures it could not explain, by name (a point it does not apply to, the logits, ...)
    unexplained: set[str] = field(default_factory=set)

    def reason(self) -> str | None:
        """The expected failure's reason: the evidence, where at least one failure is
        explained and none is left unexplained; None otherwise."""
        if self.unexplained or not self.explained:
            return None
        shown = sorted({key[0] for key in self.explained})
        return (
            f"{self.known.evidence}; with that scale taken out, every failing result passes "
            f"({', '.join(shown)})"
        )
