"""What kind of output a capture point's output is, decided once at capture and stored in the
golden set's manifest (``Point.kinds``); the judge picks its rule from it
(``model_verdict.compare_point``'s table), never from the candidate's dtypes or the names.

- ``tensor``: values, judged within the calibrated control's budget;
- ``mask``: where each position may attend (a mask the model builds, ``golden.mask_points``,
  or any boolean output), judged exactly in whatever form the candidate builds it;
- ``selection``: integer indices (a top-k), judged exactly row by row in any order;
- ``routing``: a router's weight per expert (``compare.routing``), judged on the tokens whose
  chosen experts agree and the others by their count.
"""

from __future__ import annotations

from numalign.compare.routing import ROUTING

TENSOR = "tensor"
MASK = "mask"
SELECTION = "selection"
ROUTING_KIND = "routing"
#: Every kind, in the order the judge's table lists them.
KINDS: tuple[str, ...] = (TENSOR, MASK, SELECTION, ROUTING_KIND)
#: The kinds judged within a calibrated control (their values carry rounding).
CALIBRATED_KINDS = frozenset({TENSOR, ROUTING_KIND})


def kind_of(path: str, dtype: str, *, mask_point: bool = False) -> str:
    """The kind of a point's output at ``path`` stored in ``dtype`` (a dtype name): what the
    capture knows of it when it records it, a mask point's output (``mask_point``), a router's
    routing (the path ``golden.routing`` gives it), booleans, integers, or values. Called by
    the capture, and for sets of formats before kinds were stored, once when their manifest
    is read from the dtypes it records."""
    if mask_point or dtype == "bool":
        return MASK
    if path == ROUTING:
        return ROUTING_KIND
    if not (dtype.startswith("float") or dtype.startswith("bfloat")):
        return SELECTION
    return TENSOR


def check_kind(kind: str, where: str) -> str:
    """``kind`` where it is one of ``KINDS``; ValueError naming ``where`` otherwise."""
    if kind not in KINDS:
        raise ValueError(f"{where}: unknown output kind {kind!r}; one of {', '.join(KINDS)}")
    return kind
