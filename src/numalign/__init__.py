"""numalign: numerical alignment and regression suite for LLMs on AI accelerators.

Importing numalign does not import torch; the comparison functions import it when called.
"""

from importlib.metadata import PackageNotFoundError, version

from numalign.compare import (
    CompareResult,
    CompareSpec,
    Metrics,
    Tolerance,
    TolerancePolicy,
    assert_aligned,
    compare,
    load_policy,
)
from numalign.ops.registry import candidate

try:
    __version__ = version("numalign")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "CompareResult",
    "CompareSpec",
    "Metrics",
    "Tolerance",
    "TolerancePolicy",
    "__version__",
    "assert_aligned",
    "candidate",
    "compare",
    "load_policy",
]
