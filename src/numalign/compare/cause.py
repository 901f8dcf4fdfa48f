"""The likely cause of a failing comparison, read from its error's signature.

A failure says the candidate is off; ``find_cause`` says what kind of off, from the error
``d = actual - expected`` against the truth and, where there is one, the control's error
(the honest noise of the dtype). Each label has a model of the error it names, and the
label's confidence is the share of the error's energy (``sum d**2``) that model explains:

- ``nonfinite``: NaN or Inf where the truth is finite (confidence 1);
- ``scale``: ``d = s * e`` (the error's regression on the truth);
- ``offset``: ``d = b`` (a constant shift: the mean error);
- ``clamp``: ``d = clip(e, -cap, cap) - e`` with ``cap`` the candidate's largest magnitude
  (a cap or clamp: the error only at the largest values);
- ``epsilon``: a scale per row (the last dimension) that is larger the smaller the row's
  norm (rank correlation below ``EPS_RANK``, and spanning ``EPS_RANGE``): a wrong epsilon
  moves small-norm rows only; a per-row scale of mixed signs is ``precision`` (a row's
  normalizer accumulated in low precision), of one sign and no tie to the norm ``scale``;
- ``position``: along some dimension (not the last), the positions whose error is within
  the control's noise come first and the error grows with position beyond them (rank
  correlation above ``POSITION_RANK``): a rotary error (the rotation at position 0 is the
  identity), or a wrong base, or a position-dependent scaling;
- ``mask``: the rows of some dimension (or the channels of the last) are exact within the
  control's noise while the others carry the error (an attention mask, window or padding
  letting a position through, a row or tile left out);
- ``precision``: an unbiased error some multiple of the control's everywhere (no model above
  explains it, most rows are beyond the noise by a similar factor): accumulation in low
  precision;
- ``routing``: a selection (top-k, experts) chooses other indices; ``mask`` for a mask that
  attends elsewhere (both from ``compare.exact``'s decisions);
- ``cache``: the KV cache's entries after a decode step carry an error confined to some
  positions (the ``mask`` or ``position`` signature, read on the cache's state): an entry
  written stale or into the wrong slot (``in_cache``: the decode replay's judge of the
  cache's states applies it, by step);
- ``unknown``: no model explains most of the error (confidence below ``LABEL_AT``).

The rule is never a wrong label with high confidence: a label needs its model to explain at
least ``LABEL_AT`` of the energy, and its confidence is that share, shrunk where the
signature is only partly the label's. Statistics are float64 on the CPU, a few passes, on
at most ``MAX_ELEMENTS`` elements (leading slices beyond it).

Each label's reader, and the thresholds the readers hold (``LABEL_AT``, ``EPS_RANK``, ...),
are in ``compare.cause_readers``; ``Cause`` is defined beside ``CompareResult``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from numalign.compare.cause_readers import read_cause
from numalign.compare.result import Cause
from numalign.compare.tolerances import FLOAT_FORMATS

if TYPE_CHECKING:
    import torch

    from numalign.compare.budgets import Decision

__all__ = ["LABELS", "Cause", "find_cause", "in_cache"]

#: The labels, in the order the docs list them.
LABELS: tuple[str, ...] = (
    "scale", "offset", "epsilon", "position", "mask", "precision", "clamp", "nonfinite",
    "routing", "cache", "unknown",
)  # fmt: skip
#: Labels of an error confined to some positions: in the KV cache's entries after a decode
#: step, an entry written stale or into the wrong slot (``in_cache``).
CONFINED = ("mask", "position")
#: The confidence of ``routing`` read from a rule that counted other choices (a selection's
#: indices, a router's tokens beyond the honest flips): the choice differs for certain; what
#: is left to doubt is whether a tie the honest members never met moved it.
ROUTING_CONFIDENCE = 0.9
#: Elements read at most: beyond it, the leading slices of the first dimension(s).
MAX_ELEMENTS = 1 << 22


def find_cause(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    control: torch.Tensor | None = None,
    mantissa: int = 23,
    selection: bool = False,
) -> Cause:
    """The likely cause of a failing float comparison of ``actual`` with the truth
    ``expected`` (same shape), with the honest ``control`` in the candidate's dtype where
    there is one; ``mantissa``, the candidate dtype's mantissa bits (its rounding stands in
    for the control's noise without one); ``selection``, the output is a selection's values
    (top-k, routing weights): an error no scale explains is then ``routing``."""
    import torch

    a, e, c = (_cpu64(t) for t in (actual, expected, control))
    if a.dim() == 0:
        a, e, c = a.reshape(1), e.reshape(1), c.reshape(1) if c is not None else None
    a, e, c = _bounded(a), _bounded(e), _bounded(c) if c is not None else None
    bad = ~a.isfinite() & e.isfinite()
    if bool(bad.any()):
        nan, inf = int((bad & a.isnan()).sum()), int((bad & a.isinf()).sum())
        at = tuple(int(i) for i in bad.nonzero()[0])
        return Cause(
            "nonfinite",
            f"{nan} NaN and {inf} Inf where the truth is finite, of {a.numel()} elements, "
            f"the first at {at}",
            1.0,
        )
    both = a.isfinite() & e.isfinite()
    d = torch.where(both, a - e, torch.zeros_like(a))
    e = torch.where(both, e, torch.zeros_like(e))
    energy = float((d * d).sum())
    if energy == 0.0 or d.numel() == 0:
        return Cause("unknown", "no error among the finite elements", 0.0)
    if c is not None:
        noise = torch.where(both & c.isfinite(), c - e, torch.zeros_like(e))
    else:  # one rounding of the dtype, uniform within half an ulp
        noise = e * 2.0**-mantissa / math.sqrt(3.0)
    return read_cause(d, e, noise, energy, selection)


def _cpu64(t: torch.Tensor | None) -> Any:
    import torch

    return None if t is None else t.detach().to("cpu", torch.float64)


def _bounded(t: torch.Tensor) -> torch.Tensor:
    """The leading slices of ``t``'s first dimensions, within ``MAX_ELEMENTS``."""
    while t.numel() > MAX_ELEMENTS and t.dim() > 1 and t.shape[0] > 1:
        keep = max(1, MAX_ELEMENTS // max(1, t[0].numel()))
        t = t[:keep]
        if t.numel() > MAX_ELEMENTS and t.shape[0] == 1:
            t = t[0]
    if t.numel() > MAX_ELEMENTS:
        t = t.flatten()[:MAX_ELEMENTS]
    return t


def float_cause(
    actual: torch.Tensor,
    expected: torch.Tensor,
    control: torch.Tensor | None,
    decision: Decision,
    dtype: str,
    op_class: str,
) -> Cause:
    """The likely cause of a failing float comparison (``compare()``'s): ``nonfinite``
    where rule "non-finite" failed, else read from the error's signature against the
    truth and the control run now (without one, the dtype's rounding stands in for it)."""
    if decision.rule == "non-finite":
        return Cause("nonfinite", decision.reason, 1.0)
    return find_cause(actual, expected, control=control, mantissa=FLOAT_FORMATS[dtype][0],
                      selection=op_class == "selection")  # fmt: skip


def exact_cause(decision: Decision, *, mask: bool, selection: bool) -> Cause | None:
    """The cause of a failing exact comparison: ``mask`` for a mask that attends elsewhere,
    ``nonfinite`` for its fill, ``routing`` for a selection that chooses other indices;
    ``unknown`` for other integer outputs (their difference says no more)."""
    if decision.passed:
        return None
    if decision.rule == "non-finite":
        return Cause("nonfinite", decision.reason, 1.0)
    if mask:
        return Cause("mask", f"the mask attends elsewhere: {decision.reason}", 0.95)
    if selection:
        return Cause("routing", f"the chosen indices differ: {decision.reason}", ROUTING_CONFIDENCE)
    return Cause("unknown", f"integer outputs differ: {decision.reason}", 0.0)


def in_cache(cause: Cause | None, state: str, step: int) -> Cause | None:
    """The cause of a failing comparison of the KV cache's ``state`` (``layers.0.keys``)
    after decode step ``step`` (0: the prefill's): an error confined to some of the cached
    positions (``CONFINED``) after a decode step is an entry written stale or into the wrong
    slot, ``cache``, as sure as that signature; any other signature keeps its label (a scale
    in every key is its projection's, not the cache's), and so does the prefill's cache (its
    positions are the prompt's: a mask's)."""
    if cause is None or cause.label not in CONFINED or step < 1:
        return cause
    return Cause(
        "cache",
        f"a stale or misplaced entry in the KV cache's {state} after decode step {step}: "
        f"{cause.evidence}",
        cause.confidence,
    )


def unexplained(decision: Decision) -> Cause:
    """A failure no signature was read from (a shape's): its reason, confidence 0."""
    return Cause("unknown", f"no elementwise signature to read: {decision.reason}", 0.0)
