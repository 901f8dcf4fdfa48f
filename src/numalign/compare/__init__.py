"""The comparison core: metrics, tolerance tables, verdicts, CompareSpec, CompareResult,
assert_aligned."""

from numalign.compare.core import assert_aligned, compare, dtype_name
from numalign.compare.metrics import ControlErrors, Metrics, compute_metrics
from numalign.compare.policy import TolerancePolicy, load_policy
from numalign.compare.result import RULES, CompareResult
from numalign.compare.spec import CompareSpec
from numalign.compare.tolerances import OP_CLASSES, Budget, Tolerance

__all__ = [
    "OP_CLASSES",
    "RULES",
    "Budget",
    "CompareResult",
    "CompareSpec",
    "ControlErrors",
    "Metrics",
    "Tolerance",
    "TolerancePolicy",
    "assert_aligned",
    "compare",
    "compute_metrics",
    "dtype_name",
    "load_policy",
]
