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


#: The packages in the order a newcomer reads them, bottom-up along the pipeline
#: (docs/design.md): each imports only its own layer and those before it. ``numalign`` is the
#: package's ``__init__`` (its public names), ``plugin`` the pytest entry point.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),  # errors, dtypes, names, finite JSON: no numalign import at all
    ("compare",),  # the judge: plain functions of tensors and data
    ("runtime",),  # device policy, compilation, the variant, serving arrangements
    ("records",),  # drift records, the exception policy, test ids
    ("session",),  # option values, the option table, settings
    ("ops", "numalign"),  # the operator engine, and the public names
    ("golden",),  # the reference runner and the golden sets
    ("replay",),  # calibration and the engines
    ("report",),  # tables, drift.html, baselines, Allure
    ("plugin", "plan", "sweep"),  # the pytest plugin, `numalign plan`, the day-0 sweep
    ("cli",),  # the command line
)


def layer_of(module: str) -> int:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else parts[0]
    for level, names in enumerate(LAYERS):
        if name in names:
            return level
    raise AssertionError(f"{module} belongs to no layer of LAYERS: place it there")


def test_every_package_imports_only_its_layer_and_those_below() -> None:
    """What runs (type checkers' imports aside: the runtime's hints name the settings) never
    imports back up the pipeline: golden never imports replay, the operator engine never
    imports replay, compare and the runtime import nothing above them."""
    graph = import_graph(typing=False)
    assert "numalign.golden.reference" in graph  # the graph covers the package
    upward = sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m)
    )
    assert upward == [], "\n".join(upward)


def test_no_module_is_left_loose_at_the_package_root() -> None:
    """Every module lives in its room; at the root only the public names and the plugin."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "plugin.py"], loose


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    package = tmp_path / "numalign"
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core" / "__init__.py").write_text("")
    (package / "core" / "a.py").write_text("def f():\n    from numalign.cli import b\n")
    (package / "cli").mkdir()
    (package / "cli" / "__init__.py").write_text("")
    (package / "cli" / "b.py").write_text("")
    graph = import_graph(package)
    # ``from numalign.cli import b`` imports the package and its module
    assert sorted(
        (m, d) for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m)
    ) == [("numalign.core.a", "numalign.cli"), ("numalign.core.a", "numalign.cli.b")]


def test_a_cycle_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text("from pkg.a import f\n")
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.b", "pkg.a"]]


def imported_names(folder: Path, prefix: str) -> set[tuple[str, str]]:
    """(module, name) of every import from a module under ``prefix`` in ``folder``'s files,
    function-level imports included (``import m``: (m, "*"))."""
    taken: set[tuple[str, str]] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                taken.update((a.name, "*") for a in node.names if a.name.startswith(prefix))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(prefix):
                taken.update((node.module or "", a.name) for a in node.names)
    return taken


def test_engines_hand_observations_to_the_judge_and_import_nothing_of_it() -> None:
    """An engine observes (``core.observation``) and reaches the judge through
    ``replay.judging``; no rule of ``compare`` is in its reach (docs/design.md)."""
    engines = PACKAGE / "replay" / "engines"
    observed = imported_names(engines, "numalign.core.observation")
    assert ("numalign.core.observation", "Observation") in observed  # the scan sees them
    assert imported_names(engines, "numalign.compare") == set()


def test_an_engine_importing_from_compare_is_found(tmp_path: Path) -> None:
    (tmp_path / "e.py").write_text(
        "from numalign.core.observation import Observation\n"
        "def f():\n    from numalign.compare.locate import locate\n"
    )
    assert imported_names(tmp_path, "numalign.compare") == {("numalign.compare.locate", "locate")}
