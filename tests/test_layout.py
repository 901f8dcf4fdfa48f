"""The package stays readable in pieces (docs/design.md, "Layout"): no module of src/numalign
over 500 lines, the capture's module under 400, and no function over 80 lines but the metrics
kernel, which computes every statistic of one comparison in one pass over the tensors."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "numalign"

#: A module past this many lines holds more than one purpose (issue 39: the limit the project
#: set itself after cli.py reached 919 lines).
MAX_MODULE_LINES = 500
#: The capture is the module newcomers read first; it orchestrates and delegates.
MAX_CAPTURE_LINES = 400
#: A function past this many lines does more than one named step.
MAX_FUNCTION_LINES = 80
#: The one exception: the metrics kernel reads both tensors once, in chunks, and fills every
#: statistic of the comparison in that pass; split, it would read them again.
EXEMPT_FUNCTIONS = {("compare/metrics.py", "compute_metrics")}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_over_the_limit() -> None:
    over = {
        str(p.relative_to(PACKAGE)): n for p in _modules() if (n := _lines(p)) > MAX_MODULE_LINES
    }
    assert over == {}, f"modules over {MAX_MODULE_LINES} lines: split them by purpose"


def test_the_capture_module_is_short() -> None:
    assert _lines(PACKAGE / "golden" / "capture.py") <= MAX_CAPTURE_LINES


def test_no_function_over_the_limit() -> None:
    over = []
    for path in _modules():
        where = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES and (where, node.name) not in EXEMPT_FUNCTIONS:
                    over.append(f"{where}:{node.name} ({length} lines)")
    assert over == [], f"functions over {MAX_FUNCTION_LINES} lines: {over}"
