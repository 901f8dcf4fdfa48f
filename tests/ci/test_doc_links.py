"""Every relative link of the project's documents resolves: ``ci/check_links.py`` finds them,
and this test fails on a broken one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("check_links", ROOT / "ci" / "check_links.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_relative_link_of_the_docs_resolves() -> None:
    links = _script()
    pages = links.documents(ROOT)
    assert ROOT / "README.md" in pages and ROOT / "docs" / "index.md" in pages
    assert links.broken_links(ROOT) == []


def test_a_broken_file_or_anchor_is_reported_with_its_line(tmp_path: Path) -> None:
    links = _script()
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    (tmp_path / "docs" / "guide.md").write_text("# A guide\n\n## Compiled backends (`--compile`)\n")
    (tmp_path / "README.md").write_text(
        "# x\n"
        "[ok](docs/guide.md) [ok too](docs/guide.md#compiled-backends---compile)\n"
        "[gone](docs/missing.md)\n"
        "[no heading](docs/guide.md#nowhere) [web](https://example.org/x.md)\n"
        "`[in code](docs/missing.md)`\n"
        "```\n[fenced](docs/missing.md)\n```\n"
        "[generated, not yet there](docs/reference/options.md)\n"
        "[local anchor](#x) [a link over\ntwo lines](docs/missing.md)\n"
    )
    assert links.broken_links(tmp_path) == [
        "README.md:3: docs/missing.md (no such file)",
        "README.md:4: docs/guide.md#nowhere (no heading with that anchor)",
        "README.md:10: docs/missing.md (no such file)",
    ]


def test_only_the_generated_reference_pages_may_be_absent() -> None:
    links = _script()
    assert {"docs/reference/options.md", "docs/reference/cli.md"} == links.GENERATED


def test_anchors_follow_github() -> None:
    links = _script()
    assert links.slug("Tensor-parallel replay (`--tp N`)") == "tensor-parallel-replay---tp-n"
    assert links.slug("`numalign run`: what it chooses, and why") == (
        "numalign-run-what-it-chooses-and-why"
    )
