"""CompareSpec: the terms of one ``compare()`` besides the candidate and the truth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from numalign.compare.tolerances import OP_CLASSES
from numalign.core.names import did_you_mean

if TYPE_CHECKING:
    import torch

    from numalign.compare.metrics import ControlErrors
    from numalign.compare.policy import TolerancePolicy
    from numalign.compare.tolerances import Budget, Tolerance

__all__ = ["CompareSpec"]


@dataclass(frozen=True, eq=False)
class CompareSpec:
    """What ``compare(actual, expected, spec)`` holds the candidate to: the defaults judge an
    elementwise output named "output" against the built-in (dtype, operator class) table.
    Vary it with ``CompareSpec(op_class=...)`` or ``dataclasses.replace(spec, ...)``; an
    unknown ``op_class`` raises ValueError here. It holds tensors, so two specs are equal
    only when they are the same object."""

    #: One of ``OP_CLASSES``; picks the table row when there is no control.
    op_class: str = "elementwise"
    #: The honest reference run in the candidate's dtype, of the truth's shape: the error
    #: budget is then a multiple of its error against the truth (rule "budget").
    control: torch.Tensor | None = None
    #: The control's errors where only they are known (a golden set's calibration): used as
    #: ``control`` is.
    control_errors: ControlErrors | None = None
    #: The length of the reduction behind each output element: scales the table's atol
    #: (reduction classes only) and the control budget's accumulation floor by its square root.
    reduction_length: int | None = None
    #: For index outputs (top-k, sort), the scores they select from along the last dimension:
    #: indices may then differ where the scores tie within tolerance (rule "ties").
    ties: torch.Tensor | None = None
    #: An explicit elementwise tolerance, replacing the table (for integer outputs, allowing
    #: ``atol`` of difference, e.g. 1 for rounding ties).
    tolerance: Tolerance | None = None
    #: The control multipliers where no pyproject override matches (an operator's own, where
    #: its honest alternatives round differently by design); None: the built-in ``Budget()``.
    budget: Budget | None = None
    #: The operator or capture point, for messages and pyproject overrides.
    name: str = "output"
    #: Overrides from ``[tool.numalign]``; None: the built-in tables.
    policy: TolerancePolicy | None = None
    #: The reference magnitude up to which an exact zero in the candidate is chance (an honest
    #: value rounded onto zero): exact zeros count against rule "distribution" only where the
    #: reference lies beyond it.
    zero_reach: float | None = None
    #: The error carries honest differences from upstream (a whole model's point, a decode
    #: step): against a calibration, its norm may move as far as its relative L2 budget allows.
    propagated: bool = False
    #: For an output through exponentials (a softmax), the farthest an exponent's argument lies
    #: below its row's maximum (natural units): the systematic scale's floor takes in that many
    #: roundings of a constant folded into the exponent (``Operator.exponent_reach``).
    exponent_reach: float | None = None

    def __post_init__(self) -> None:
        if self.op_class not in OP_CLASSES:
            raise ValueError(
                f"Unknown operator class {self.op_class!r}; allowed: {', '.join(OP_CLASSES)}."
                + did_you_mean(self.op_class, OP_CLASSES)
            )
