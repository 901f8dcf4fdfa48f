"""The model verdict: a capture point's output against its control (``compare_point``), the
logits' agreement (``judge_logits``), and the result objects of a replay: every point's
comparison (``PointResult``), the first divergence (``Divergence``: local, accumulated, input,
output, unlocated, or at a decode step), the logits' and the greedy continuation's agreement
and an encoder's final outputs (``ModelVerdict``), each with the message a failing test
shows. Decode's verdict is ``compare.decode_verdict``. Replay (``numalign.replay``) runs the
models and hands the tensors here; it turns these results into drift records
(``replay.verdict``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from numalign.compare.calibration import Control
from numalign.compare.core import compare
from numalign.compare.logits import LogitsStats, kl_budget, logits_stats, near_tie
from numalign.compare.metrics import ControlErrors
from numalign.compare.output_kind import CALIBRATED_KINDS, MASK, ROUTING_KIND, SELECTION, TENSOR
from numalign.compare.policy import DEFAULT_POLICY, thresholds_of
from numalign.compare.result import CompareResult
from numalign.compare.routing import agreeing, judge_flips
from numalign.compare.spec import CompareSpec
from numalign.compare.statistics import judge_statistics
from numalign.compare.tolerances import FLOAT_FORMATS, Thresholds
from numalign.core import dtypes
from numalign.core.errors import UNCALIBRATED, Unsupported
from numalign.core.observation import label
from numalign.core.statistics import DEFAULT_WIDTH, TensorStatistics, statistics_of

if TYPE_CHECKING:
    import torch


class ReplayUnsupported(Unsupported, RuntimeError):
    """A model verdict that cannot be reached as asked: the test is skipped with the reason
    (replay raises it where transformers cannot load the model with the asked-for
    implementation: Gemma 2 has no SDPA path, say)."""


class Uncalibrated(ReplayUnsupported):
    """The set has no calibration of a point in the replay's dtype (``--calibrate ''``): the
    replay is skipped with that reason, never judged against a budget of one ulp."""

    rule = UNCALIBRATED


# -- judging one point ---------------------------------------------------------------------------
def compare_point(
    actual: torch.Tensor,
    expected: torch.Tensor | TensorStatistics,
    name: str,
    control: Control,
    policy: Any,
    kind: str = TENSOR,
) -> CompareResult:
    """One output of a point (whole: a tensor-parallel rank's shard gathered first) against
    the golden one, by the rule of its ``kind`` (``compare.output_kind``, stored in the set at
    capture; ``_JUDGES``): a mask exactly as where each position attends (``exact.judge_mask``
    of the mask in whatever form the candidate built it, an additive mask's fill included); a
    selection as each row's values in any order (a top-k's order is its kernel's: GLM-DSA's
    indexer returns its masked keys, tied at -inf, in any order); a router's routing
    (``compare.routing``) on the tokens whose chosen experts agree and the others by their
    count; a tensor within its control's budget. A kind judged within a control is
    Uncalibrated where the control is not calibrated. A tensor the set keeps as statistics
    only (``expected`` a ``TensorStatistics``) is judged by them (``compare.statistics``), and so
    is a tensor whose control was measured on statistics (``Control.whole`` false), its
    statistics taken here with a sketch four times its size (an estimate within
    3 / sqrt(8 n) of its error's norm)."""
    judge = _JUDGES.get(kind)
    if judge is None:
        raise ValueError(f"{name}: no rule for output kind {kind!r}; one of {', '.join(_JUDGES)}")
    if kind in CALIBRATED_KINDS and not control.calibrated:
        raise _uncalibrated(name, dtypes.dtype_name(actual.dtype))
    if not isinstance(expected, TensorStatistics) and kind == TENSOR and not control.whole:
        # a tensor whose control the calibration measured on statistics only (the residual
        # stream a fused norm returns, judged by its block's control): judged the same way
        expected = statistics_of(expected, max(DEFAULT_WIDTH, 4 * expected.numel()))
    if isinstance(expected, TensorStatistics):  # kept as statistics only: judged by them
        return judge_statistics(actual, expected, name, control, policy)
    return judge(actual, expected, name, control, policy)


def _uncalibrated(name: str, dtype: str) -> Uncalibrated:
    """Why an output without a calibrated control is not judged (a budget without a control
    would be one ulp)."""
    return Uncalibrated(
        f"{name}: the golden set has no calibration of it in {dtype} (captured with "
        f"--calibrate '' or without {dtype}; for an output the {dtype} ensemble cannot "
        "measure, eager attention weights, without the bfloat16 or float16 calibration "
        "its control is borrowed from): not judged, since a budget without a control "
        "would be one ulp and the tolerance table is not made for whole modules; capture "
        f"it again with --calibrate {dtype} (with bfloat16 too for such an output)"
    )


def _judge_mask(
    actual: torch.Tensor, expected: torch.Tensor, name: str, control: Control, policy: Any
) -> CompareResult:
    """A mask the model builds, judged as where it attends; recorded in the dtype the
    candidate built it in (an additive mask: the replay's)."""
    return replace(compare(actual, expected, CompareSpec(name=name)),
                   dtype=dtypes.dtype_name(actual.dtype))  # fmt: skip


def _judge_selection(
    actual: torch.Tensor, expected: torch.Tensor, name: str, control: Control, policy: Any
) -> CompareResult:
    """Integer indices, each row's in any order."""
    if actual.shape == expected.shape and actual.dim() > 0:
        actual, expected = actual.sort(-1).values, expected.sort(-1).values
    return compare(actual, expected, CompareSpec(name=name))


def _judge_routing(
    actual: torch.Tensor, expected: torch.Tensor, name: str, control: Control, policy: Any
) -> CompareResult:
    """A router's weight per expert: on the tokens choosing the same experts within the
    control, and the others counted against the ensemble's flips."""
    if actual.shape != expected.shape:  # the shape rule names it
        return _within_control(actual, expected, name, control, policy)
    actual, expected, flips, tokens = agreeing(actual, expected)
    result = _within_control(actual, expected, name, control, policy)
    return judge_flips(result, flips, tokens, control.flips, thresholds_of(policy))


def _within_control(
    actual: torch.Tensor, expected: torch.Tensor, name: str, control: Control, policy: Any
) -> CompareResult:
    """A floating output against the golden one within its calibrated control's budget."""
    reach = chance_zero_reach(control.errors, expected, dtypes.dtype_name(actual.dtype),
                              thresholds_of(policy))  # fmt: skip
    spec = CompareSpec(
        op_class="matmul", control_errors=control.errors, reduction_length=control.reduction,
        name=name, policy=policy, zero_reach=reach, propagated=control.propagated,
    )  # fmt: skip
    return compare(actual, expected, spec)


#: The rule of each output kind (``compare.output_kind.KINDS``), as torch's comparison orders
#: its pairs by type: one entry a kind.
_JUDGES = {
    TENSOR: _within_control,
    MASK: _judge_mask,
    SELECTION: _judge_selection,
    ROUTING_KIND: _judge_routing,
}


def chance_zero_reach(
    errors: ControlErrors, expected: torch.Tensor, dtype: str, thresholds: Thresholds | None = None
) -> float | None:
    """How far from zero the reference may lie where an honest candidate lands exactly on
    zero: the control's worst error plus ``zero_reach_roundings`` roundings (ulps in
    ``dtype``) of the output's largest magnitude (None where the dtype or the output gives no
    scale).

    A model's outputs are sums rounded to the dtype (a residual add, a row-parallel
    all-reduce of partial sums, a fused kernel's accumulation). An honest candidate's value
    before that last rounding is the reference plus its honest error (at most the ensemble's
    worst, ``errors.max_abs``); where that sum is smaller than one rounding of the addends, the
    rounded sum lands exactly on zero (``a + b == 0`` in bfloat16). The reference in float32
    almost never does, each honest implementation at other places. Those zeros are chance;
    the output's largest magnitude stands for the addends' scale. Zeros where the reference
    lies beyond the reach (a zeroed tile or row) still fail, counted position by position."""
    if dtype not in FLOAT_FORMATS or not expected.numel():
        return None
    largest = float(expected.abs().max())
    if largest == 0 or not math.isfinite(largest):
        return None
    ulp = 2.0 ** (math.floor(math.log2(largest)) - FLOAT_FORMATS[dtype][0])
    roundings = (thresholds or Thresholds()).zero_reach_roundings * ulp
    return roundings + (errors.max_abs if math.isfinite(errors.max_abs) else 0.0)


def judge_logits(
    request: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    control: Control,
    policy: Any = None,
) -> LogitsResult:
    """One request's logits ([kept positions, vocab]) against the golden ones: values within
    the calibrated budget, top-1 and top-5 differences only among near ties (golden logits
    ``logits.near_tie`` of the max-abs budget: each of two logits may move by the budget),
    and KL within ``logits.kl_budget``: the squared spread of the budget times the control's
    KL plus a rounding floor (the thresholds are the policy's: ``[tool.numalign.thresholds]``)."""
    if not control.calibrated or control.kl_max is None:
        return LogitsResult(
            request, None, None,
            skipped="the golden set has no logits calibration in this dtype (captured with "
            "--calibrate '' or without it, or by an older numalign): capture it again with "
            "--calibrate DTYPE to judge the logits",
        )  # fmt: skip
    values = compare_point(actual, expected, "logits", control, policy)
    thresholds = thresholds_of(policy)
    tie = near_tie(float(values.budget.get("max_abs", 0.0)), thresholds)
    stats = logits_stats(actual.flatten(0, -2), expected.flatten(0, -2), tie)
    dtype = dtypes.dtype_name(actual.dtype)
    spread = (policy or DEFAULT_POLICY).budget("logits", dtype, None).rel_l2_multiplier
    largest = float(expected.abs().max()) if expected.numel() else 0.0
    ulp = 2.0 ** (math.floor(math.log2(largest)) - FLOAT_FORMATS[dtype][0]) if largest > 0 else 0.0
    vocab = int(expected.shape[-1]) if expected.dim() else 1
    budget = kl_budget(spread, control.kl_max, ulp, vocab, thresholds)
    return LogitsResult(request, values, stats, budget)


# -- results -----------------------------------------------------------------------------------
@dataclass
class PointResult:
    """One output of one call of a capture point (or of the model itself) in one request."""

    point: str
    order: int
    request: str
    path: str
    result: CompareResult
    mode: str = "accumulated"
    #: when the point's call completed in the forward (children before their parents)
    finished: int = 0
    #: the decode step (0: the prefill's cache) in decode replay; None elsewhere
    step: int | None = None
    #: which recorded call of the point in its request (0: the first)
    call: int = 0

    @property
    def label(self) -> str:
        return label(self.point, self.path)


@dataclass(frozen=True)
class DecodeLocation:
    """Where a decode divergence lives (``replay.decode_locate``): ``kind`` local,
    accumulated or unlocated; ``named``: a point before it that fails its own check
    (accumulated), or None; ``why``: the reason."""

    kind: str
    named: str | None
    why: str


@dataclass(frozen=True)
class Divergence:
    """The first point whose error leaves its budget. In the whole-model replay ``kind`` is
    ``local`` when the point fails alone too (fed the golden inputs), ``input`` when it fails
    alone fed one of the model's own inputs that no capture point covers (a mask, position
    embeddings), ``accumulated`` when the error comes with the hidden states from upstream,
    ``output`` when only the logits fail (the model's final logit transform), ``unlocated``
    when the point cannot run alone. In decode replay ``kind`` is ``decode``: the first step
    (``step``; None for a lean pooled over every step), and in it the first point in forward
    order (its label), with where it lives (``location``)."""

    point: str
    kind: str
    request: str
    result: CompareResult
    #: for kind ``unlocated``: why the point could not be replayed alone; for ``output``:
    #: what the model does after its last capture point
    why_unlocated: str | None = None
    #: for kind ``input``: the inputs the model fed the point that make it fail alone, with
    #: how each differs from the golden one
    inputs: tuple[tuple[str, str], ...] = ()
    #: for kind ``accumulated``: a point before it that fails alone (the module at fault)
    named: str | None = None
    #: for kind ``decode``: the step (0: the prefill's cache; None: every step pooled)
    step: int | None = None
    #: for kind ``decode``: where it lives (None where it was not located)
    location: DecodeLocation | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "decode":
            decode: dict[str, Any] = {"point": self.point, "step": self.step,
                                      "request": self.request, "kind": "decode"}  # fmt: skip
            if self.location is not None:
                decode["located"] = self.location.kind
                if self.location.named:
                    decode["named"] = self.location.named
            return decode
        out: dict[str, Any] = {"point": self.point, "kind": self.kind, "request": self.request}
        if self.inputs:
            out["inputs"] = [name for name, _ in self.inputs]
        if self.kind == "output":
            out["why"] = str(self.why_unlocated)
        if self.named:
            out["named"] = self.named
        return out

    def describe(self) -> str:
        if self.kind == "decode":
            return self._describe_decode()
        fed = "; ".join(f"{name} ({differs})" for name, differs in self.inputs)
        why = {
            "local": "the point alone fails too",
            "accumulated": "the point alone is within budget; the error comes with its hidden "
            "states from upstream"
            + (f", from {self.named}, which fails alone" if self.named else ""),
            "input": "the point alone on the golden inputs is within budget, and fails fed "
            f"the model's own {fed}: the fault is in how the model computes or hands on that "
            "input, which no capture point covers",
            "output": str(self.why_unlocated),
        }.get(self.kind, f"not replayed alone: {self.why_unlocated}")
        return (
            f"first divergence at {self.point} ({self.kind}: {why}), request {self.request}:\n"
            f"{self.result.message()}"
        )

    def _describe_decode(self) -> str:
        where = {0: "the prefill's cache", None: "every decode step pooled"}.get(
            self.step, f"decode step {self.step}"
        )
        located = "" if self.location is None else (
            f" ({self.location.kind}: {self.location.why})")  # fmt: skip
        return (
            f"first divergence at {where}, {self.point}, request {self.request}{located}:\n"
            f"{self.result.message()}"
        )


@dataclass
class LogitsResult:
    """The logits of one request: their values against the calibrated budget (``values``:
    max abs, relative L2, distribution), and the agreement statistics, each judged: top-1
    and top-5 differences must be explained by near ties (golden logits within twice the
    max-abs budget), KL at most the squared spread times the control's plus a rounding floor.
    ``skipped`` says why nothing was judged (a set without logits calibration)."""

    request: str
    values: CompareResult | None
    stats: LogitsStats | None
    kl_budget: float = math.inf
    skipped: str | None = None
    #: the decode step of decode replay's logits; None for the prefill's
    step: int | None = None

    @property
    def problems(self) -> list[str]:
        if self.values is None or self.stats is None:
            return []
        out = []
        if not self.values.passed:
            out.append(f"values: {self.values.reason}")
        s = self.stats
        if s.top1_unexplained:
            out.append(
                f"top-1 differs at {s.top1_unexplained} of {s.positions} positions where the "
                f"golden logits are more than {s.near_tie:.3g} apart (not a near tie)"
            )
        if s.top5_unexplained:
            out.append(
                f"a golden top-5 token is pushed out at {s.top5_unexplained} of {s.positions} "
                f"positions by a token more than {s.near_tie:.3g} below it"
            )
        if not s.kl_max <= self.kl_budget:  # a NaN KL (non-finite logits) fails too
            out.append(f"KL divergence {s.kl_max:.4g} exceeds its budget {self.kl_budget:.4g}")
        return out

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def kl_used(self) -> float:
        """How far the KL goes towards its budget (1: at it)."""
        if self.stats is None:
            return 0.0
        if math.isnan(self.stats.kl_max):
            return math.inf  # non-finite logits: the worst use, never "no growth"
        return self.stats.kl_max / self.kl_budget if self.kl_budget > 0 else 0.0

    def message(self) -> str:
        """What fails, with the values' own message where they fail."""
        values = self.values
        return (
            f"logits of {self.request}: "
            + "\n".join(self.problems)
            + ("\n" + values.message() if values is not None and not values.passed else "")
        )


@dataclass
class ContinuationResult:
    """Greedy tokens of the replay against the golden continuation, teacher-forced: identical
    up to ``first_divergence``, and there the two tokens' golden logits at most ``near_tie``
    apart (``gap``)."""

    request: str
    steps: int
    first_divergence: int | None
    gap: float
    near_tie: float

    @property
    def passed(self) -> bool:
        return self.first_divergence is None or self.gap <= self.near_tie

    @property
    def reason(self) -> str:
        return (
            "every greedy token agrees"
            if self.first_divergence is None
            else f"first differing token at step {self.first_divergence}, golden logits "
            f"{self.gap:.3g} apart (near-tie allowance {self.near_tie:.3g})"
        )

    @property
    def budget_used(self) -> float | None:
        """The gap over the near-tie allowance (None where that is not a number)."""
        used = (
            0.0
            if self.first_divergence is None
            else (self.gap / self.near_tie if self.near_tie > 0 else math.inf)
        )
        return used if math.isfinite(used) else None


@dataclass
class ModelVerdict:
    """Everything a full-model replay judged, with the first divergence located."""

    points: list[PointResult]
    logits: list[LogitsResult] = field(default_factory=list)
    continuation: list[ContinuationResult] = field(default_factory=list)
    #: an encoder's final outputs (last hidden state, pooled output), mode "output"
    outputs: list[PointResult] = field(default_factory=list)
    divergence: Divergence | None = None
    #: points (or outputs) the engine has no counterpart for, with the reason: skipped records
    unmapped: dict[str, str] = field(default_factory=dict)

    @property
    def first_failing(self) -> PointResult | None:
        return first_divergence(self.points)

    @property
    def passed(self) -> bool:
        return (
            self.divergence is None
            and all(r.passed for r in self.logits)
            and all(r.passed for r in self.continuation)
            and all(o.result.passed for o in self.outputs)
        )

    def message(self, title: str) -> str:
        problems = [self.divergence.describe()] if self.divergence is not None else []
        problems += [
            f"model output {o.label}, request {o.request}:\n{o.result.message()}"
            for o in self.outputs
            if not o.result.passed
        ]
        problems += [
            f"logits of {r.request}: " + "; ".join(r.problems) for r in self.logits if not r.passed
        ]
        problems += [
            f"greedy continuation of {c.request}: first differing token at step "
            f"{c.first_divergence}, golden logits {c.gap:.3g} apart (allowed {c.near_tie:.3g})"
            for c in self.continuation
            if not c.passed
        ]
        return f"{title}: " + "\n\n".join(problems)


def first_divergence(results: list[PointResult]) -> PointResult | None:
    """The first point, in the order calls completed in the forward (a block's norm before
    the block), whose error leaves its budget."""
    failing = [r for r in results if not r.result.passed]
    return min(failing, key=lambda r: r.finished) if failing else None


def layer_message(title: str, results: list[PointResult]) -> str | None:
    """The failure message of one point's layer replay (None when every output passed): how
    many outputs left the isolated budget, and the worst, once per test."""
    failed = [r for r in results if not r.result.passed]
    if not failed:
        return None
    w = worst(failed)
    requests = sorted({r.request for r in failed})
    return (
        f"{title} replayed alone leaves the isolated calibration's budget in {len(failed)} of "
        f"{len(results)} outputs (requests {', '.join(requests)}); worst, request "
        f"{w.request}:\n{w.result.message()}"
    )


def worst(results: list[PointResult]) -> PointResult:
    """The result that uses the most of its budget (a failure without a finite use first)."""

    def used(r: PointResult) -> float:
        u = r.result.budget_used
        return math.inf if not r.result.passed and not math.isfinite(u) else u

    return max(results, key=used)
