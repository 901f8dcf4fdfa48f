"""CompareResult: every metric, the budget that applied, the verdict and the rule that decided
it, and a failure's likely ``Cause``; assertions only format it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from numalign.compare.metrics import Metrics
from numalign.compare.power import Detectable

#: The verdict rules (docs/comparison.md), in the order they apply.
RULES: tuple[str, ...] = (
    "shape",
    "non-finite",
    "exact",
    "ties",
    "rounding",
    "budget",
    "tolerance",
    "distribution",
)


@dataclass(frozen=True)
class Cause:
    """A failure's likely cause (``compare.cause``, which reads it): ``label`` (one of
    ``cause.LABELS``), ``evidence`` (one line, with the numbers) and ``confidence`` in [0, 1]
    (the share of the error's energy the label's model explains, shrunk where its signature
    is partial; low for ``unknown``)."""

    label: str
    evidence: str
    confidence: float

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "evidence": self.evidence,
                "confidence": round(float(self.confidence), 3)}  # fmt: skip

    def line(self) -> str:
        """The failure message's line."""
        return f"Likely cause: {self.label} (confidence {self.confidence:.2f}): {self.evidence}"


@dataclass(frozen=True)
class CompareResult:
    """The outcome of one comparison.

    ``budget`` holds what applied: for rule "budget" the limits ``max_abs`` and ``rel_l2`` with
    the multipliers and the control's errors; for rule "tolerance" ``rtol`` and ``atol``.
    ``budget_used`` is the worst error over its allowance (above 1 fails). ``detectable``
    is the verdict's power (``compare.power``): the smallest scale and bias its rules would
    have caught; None for outputs judged exactly (integers, selections, masks, rounding).
    ``cause`` is a failure's likely cause (``compare.cause``: a label, its evidence and a
    confidence), read from the error's signature; None for a pass, and for results no
    ``compare()`` concluded (rounding, routing flips), which keep their reason and hint.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    op_class: str
    passed: bool
    rule: str
    reason: str
    metrics: Metrics
    control: Metrics | None = None
    budget: dict[str, float] = field(default_factory=dict)
    budget_used: float = 0.0
    hint: str | None = None
    detectable: Detectable | None = None
    cause: Cause | None = None

    def message(self) -> str:
        """A failure message in the style of ``torch.testing.assert_close``: what, how
        much, the budget and which rule failed, and a hint."""
        m = self.metrics
        shape = "x".join(str(s) for s in self.shape) or "scalar"
        verdict = "aligned" if self.passed else "not aligned"
        lines = [
            f"{self.name} [{self.dtype}, {shape}] is {verdict}: {self.reason} (rule: {self.rule})"
        ]
        if m.numel:
            lines.append(
                f"Mismatched elements: {m.mismatch_count} / {m.numel} ({_pct(m.mismatch_fraction)})"
            )
        if m.worst_index is not None:
            lines.append(
                f"Greatest absolute difference: {_g(m.max_abs)} at index {_index(m.worst_index)} "
                f"(actual {_g(m.worst_actual)}, expected {_g(m.worst_expected)})"
            )
            lines.append(
                f"Greatest relative difference: {_g(m.max_rel)}; ulp error max {_g(m.ulp_max)}, "
                f"p99 {_g(m.ulp_p99)}"
            )
            lines.append(
                f"Relative L2 error: {_g(m.rel_l2)}; cosine {_g(m.cosine, 8)}; "
                f"norm ratio {_g(m.norm_ratio, 6)}"
            )
        if m.nan_actual or m.nan_expected or m.inf_actual or m.inf_expected:
            lines.append(
                f"Non-finite: NaN {m.nan_actual} (reference {m.nan_expected}), "
                f"Inf {m.inf_actual} (reference {m.inf_expected})"
            )
        if self.budget:
            lines.append(f"Budget: {self.budget_text()}")
        if self.hint:
            lines.append(f"Hint: {self.hint}")
        if self.cause is not None and not self.passed:
            lines.append(self.cause.line())
        return "\n".join(lines)

    def budget_text(self) -> str:
        b = self.budget
        if "max_abs" in b:
            walk_abs = f" + accumulation {_g(b['accumulation'])}" if b.get("accumulation") else ""
            walk_rel = (
                f" + accumulation {_g(b['accumulation_rel'])}" if b.get("accumulation_rel") else ""
            )
            tail = b.get("control_tail", b["control_max_abs"])
            control = (
                f"control {_g(b['control_max_abs'])}"
                if tail <= b["control_max_abs"]
                else f"the control's tail {_g(tail)} (its worst {_g(b['control_max_abs'])})"
            )
            return (
                f"max abs <= {_g(b['max_abs'])} = {_g(b['max_abs_multiplier'])} x {control}"
                f" + 1 ulp {_g(b['floor'])}{walk_abs}; relative L2 <= "
                f"{_g(b['rel_l2'])} = {_g(b['rel_l2_multiplier'])} x control "
                f"{_g(b['control_rel_l2'])} + eps {_g(b['eps'])}{walk_rel}"
            )
        if "rtol" in b:
            text = (
                "|actual - expected| <= atol + rtol * |expected| with "
                f"rtol={_g(b['rtol'])}, atol={_g(b['atol'])}"
            )
            if b.get("reduction_length"):
                text += f" (atol scaled by sqrt({int(b['reduction_length'])}))"
            return text
        return ", ".join(f"{k}={_g(v)}" for k, v in b.items())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: non-finite floats become None."""
        out: dict[str, Any] = _json_ready(
            {
                "name": self.name,
                "dtype": self.dtype,
                "shape": list(self.shape),
                "op_class": self.op_class,
                "passed": self.passed,
                "rule": self.rule,
                "reason": self.reason,
                "hint": self.hint,
                "budget": dict(self.budget),
                "budget_used": self.budget_used,
                "metrics": self.metrics.to_dict(),
                "control": self.control.to_dict() if self.control else None,
                "detectable": self.detectable.to_dict() if self.detectable else None,
                "cause": self.cause.to_dict() if self.cause else None,
            }
        )
        return out


def _json_ready(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


def _g(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}g}"


def _pct(fraction: float) -> str:
    pct = 100.0 * fraction
    if 0 < pct < 0.01:
        return "<0.01%"
    return f"{pct:.2f}%"


def _index(index: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(i) for i in index) + ")"
