"""The engine's data flow runs one way: no module of src/numalign imports a module that
imports it back, function-level imports included (docs/design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "numalign"


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def _type_checking_imports(tree: ast.AST) -> set[ast.AST]:
    """The import nodes under ``if TYPE_CHECKING:``: for type checkers only, never run."""
    found: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                found.update(
                    n for n in ast.walk(child) if isinstance(n, ast.Import | ast.ImportFrom)
                )
    return found


def import_graph(package: Path = PACKAGE, *, typing: bool = True) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source (top level or inside
    functions; ``from a import b`` counts as importing ``a.b`` when that is a module);
    ``typing=False`` leaves out the imports under ``if TYPE_CHECKING:`` (what runs)."""
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = set() if typing else _type_checking_imports(tree)
        for node in ast.walk(tree):
            if node in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # a package's __init__ re-exporting its own modules is not a cycle
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_no_import_cycle_in_the_engine() -> None:
    graph = import_graph()
    assert "numalign.golden.reference" in graph  # the graph covers the package
    found = cycles(graph)
    assert found == [], "\n".join(" -> ".join(c) for c in found)


def test_the_golden_package_does_not_import_replay() -> None:
    """Capture records; replay compares: golden sits below replay, never the reverse."""
    graph = import_graph()
    golden = {m: deps for m, deps in graph.items() if m.startswith("numalign.golden")}
    assert all(not d.startswith("numalign.replay") for deps in golden.values() for d in deps)


#: The operator engine: operator specs, cases, truths, one operator case run.
OPERATOR_ENGINE = ("numalign.opcheck", "numalign.truths", "numalign.cases", "numalign.registry")
#: What the runtime package sits below: none of it may be imported from it.
ABOVE_RUNTIME = ("replay", "golden", "record", "report", "plugin")


def reached(graph: dict[str, set[str]], starts: tuple[str, ...]) -> set[str]:
    """Every package module ``starts`` import, directly or through other modules."""
    seen: set[str] = set()
    stack = list(starts)
    while stack:
        for dep in graph[stack.pop()]:
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return seen


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == f"numalign.{p}" or module.startswith(f"numalign.{p}.") for p in packages)


def test_the_operator_engine_never_imports_replay() -> None:
    """Operators run on the runtime (device policy, compilation), not on the replays: nothing
    the operator engine imports, directly or not, is a module of ``numalign.replay``."""
    graph = import_graph()
    assert all(m in graph for m in OPERATOR_ENGINE)
    found = sorted(m for m in reached(graph, OPERATOR_ENGINE) if _within(m, ("replay",)))
    assert found == []
    assert "numalign.runtime.compiled" in reached(graph, ("numalign.opcheck",))


def test_the_runtime_imports_nothing_above_it() -> None:
    """``numalign.runtime`` is used by the operator engine and the replays and runs no import
    of replay, golden, record, report or plugin, directly or not (its type hints name the
    settings, which validate a baseline's records: for type checkers only)."""
    graph = import_graph(typing=False)
    runtime = tuple(m for m in graph if _within(m, ("runtime",)))
    assert {"numalign.runtime.devices", "numalign.runtime.compiled"} <= set(runtime)
    found = sorted(m for m in reached(graph, runtime) if _within(m, ABOVE_RUNTIME))
    assert found == []


def test_a_module_reached_through_another_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text("import pkg.c\n")
    (package / "c.py").write_text("")
    assert reached(import_graph(package), ("pkg.a",)) == {"pkg.b", "pkg.c"}


def test_a_cycle_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text("from pkg.a import f\n")
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.b", "pkg.a"]]


#: What compare sits below: the engine's upper rooms, which may import compare, never the
#: reverse (docs/design.md): the verdict rules are plain functions of tensors and data.
ABOVE_COMPARE = (
    "numalign.replay", "numalign.golden", "numalign.record", "numalign.report",
    "numalign.plugin", "numalign.settings", "numalign.cli", "numalign.opcheck",
    "numalign.registry",
)  # fmt: skip


def test_compare_imports_nothing_above_it() -> None:
    graph = import_graph()
    compare = {m: deps for m, deps in graph.items() if m.startswith("numalign.compare")}
    assert "numalign.compare.rounding" in compare  # the graph covers the package
    above = {
        (m, d)
        for m, deps in compare.items()
        for d in deps
        if any(d == a or d.startswith(a + ".") for a in ABOVE_COMPARE)
    }
    assert above == set(), sorted(above)
