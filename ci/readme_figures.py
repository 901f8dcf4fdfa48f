"""Regenerates the figures block of docs/measurements.md from what the repository holds: test
counts collected by pytest (never typed), the catalogue's operators, the zoo's models and sets.

    python ci/readme_figures.py          # rewrite the block in docs/measurements.md
    python ci/readme_figures.py --check  # exit 1, with a diff, when the block is stale

``tests/ci/test_readme_figures.py`` runs the check, so a stale block fails the project's
tests. The block lies between the two ``figures`` comment lines of docs/measurements.md (the
README links there rather than quoting counts that every new test would make stale). The
script keeps its name from when the block was in the README.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The page that holds the block.
PAGE = ROOT / "docs" / "measurements.md"
BEGIN = "<!-- figures:begin (python ci/readme_figures.py writes this block; do not edit) -->"
END = "<!-- figures:end -->"


def collected(*args: str) -> int:
    """How many tests ``pytest --collect-only`` selects with ``args`` (deselected excluded)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         *args],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    match = re.search(r"(\d+)(?:/\d+)? tests? collected", done.stdout)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"pytest --collect-only {' '.join(args)} failed:\n{done.stdout[-2000:]}")
    return int(match[1])


#: The test files that need vLLM (skipped as modules elsewhere).
VLLM_TESTS = ("tests/replay/test_vllm_engine.py", "tests/replay/test_vllm_serving.py")


def _vllm_tests() -> int:
    """The tests of VLLM_TESTS, counted from their source (collecting them needs vLLM): a
    parametrized test once per value of its list."""
    import ast

    count = 0
    for path in VLLM_TESTS:
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                params = [d for d in node.decorator_list if "parametrize" in ast.unparse(d)]
                count += sum(len(d.args[1].elts) for d in params) or 1  # type: ignore[attr-defined]
    return count


def figures() -> list[str]:
    """The block's lines."""
    sys.path.insert(0, str(ROOT / "src"))
    from numalign.ops.registry import OPERATORS, load_catalogue

    load_catalogue()
    models = sorted(p.name for p in (ROOT / "golden" / "models").iterdir() if p.is_dir())
    sets = sorted(p.name for p in (ROOT / "golden" / "sets").iterdir()
                  if (p / "manifest.json").is_file())  # fmt: skip
    rows = [
        # the vLLM engine's tests collect only where vLLM is installed (CI's vLLM venv):
        # counted apart, so the block reads the same in both environments
        (
            "numalign's own tests (`pytest tests`; the vLLM engine's apart)",
            collected("tests", *(f"--ignore={path}" for path in VLLM_TESTS)),
        ),
        ("the vLLM engine's tests (where vLLM is installed)", _vllm_tests()),
        ("operator suite, tier smoke", collected("suites/operators", "--tier", "smoke")),
        ("operator suite, tier pr", collected("suites/operators", "--tier", "pr")),
        ("model suites (layer, model, decode), tier pr", collected("suites/models")),
    ]
    return [
        BEGIN,
        "| what | count |",
        "| --- | --- |",
        *(f"| {what} | {n} |" for what, n in rows),
        f"| catalogue operators | {len(OPERATORS)} |",
        f"| zoo models (`golden/models`) | {len(models)} |",
        f"| golden sets (`golden/sets`) | {len(sets)} |",
        END,
    ]


def current(text: str) -> list[str] | None:
    """The block as the page has it, or None where it has none."""
    lines = text.splitlines()
    if BEGIN not in lines or END not in lines:
        return None
    return lines[lines.index(BEGIN) : lines.index(END) + 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--check", action="store_true", help="exit 1 when the block is stale")
    args = parser.parse_args(argv)
    text = PAGE.read_text(encoding="utf-8")
    have, want = current(text), figures()
    if args.check:
        if have == want:
            return 0
        name = PAGE.relative_to(ROOT).as_posix() if PAGE.is_relative_to(ROOT) else PAGE.name
        diff = difflib.unified_diff(have or [], want, name, "collected", lineterm="")
        print(f"{name}'s figures are stale: run python ci/readme_figures.py\n" + "\n".join(diff))
        return 1
    if have is None:
        raise SystemExit(f"{PAGE} has no figures block: add the lines {BEGIN!r} and {END!r}")
    lines = text.splitlines()
    start, end = lines.index(BEGIN), lines.index(END)
    PAGE.write_text("\n".join([*lines[:start], *want, *lines[end + 1 :]]) + "\n", encoding="utf-8")
    print(f"{PAGE}: figures block rewritten ({len(want) - 2} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
