"""Every benchmark's numalign imports resolve: benches import inside ``main`` (so that
``--help`` is cheap), where a moved name is only found when someone runs them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def unresolved(folder: Path) -> list[str]:
    """``file: module.name`` for each ``from numalign... import name`` under ``folder``
    that names nothing there."""
    missing = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(
                "numalign"
            ):
                continue
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                if hasattr(module, alias.name):
                    continue
                try:  # a submodule the package does not import itself
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    missing.append(f"{path.name}: {node.module}.{alias.name}")
    return missing


def test_every_benchmarks_numalign_imports_resolve() -> None:
    assert list(BENCH.glob("bench_*.py")), "the benchmarks are where this test looks"
    assert unresolved(BENCH) == []


def test_a_moved_name_is_found(tmp_path: Path) -> None:
    (tmp_path / "bench_x.py").write_text(
        "def main():\n    from numalign.core.dtypes import torch_dtype, no_such_name\n"
    )
    assert unresolved(tmp_path) == ["bench_x.py: numalign.core.dtypes.no_such_name"]
