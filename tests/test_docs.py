"""The documentation site: every page is in mkdocs.yml's nav, code blocks compile, cited shardax names exist.

The site itself is built by CI (`mkdocs build --strict`, .ci/run), which also checks links and anchors; these tests
need no mkdocs install.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import shardax as sx

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CHECKED_PAGES = ["getting-started.md", "migration.md"]

_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SX_NAME = re.compile(r"(?<![\w.])sx((?:\.[A-Za-z_]\w*)+)")


def _nav_pages() -> set[str]:
    """The .md files named in the `nav:` section of mkdocs.yml (read as text: no YAML library needed)."""
    text = (ROOT / "mkdocs.yml").read_text()
    start = re.search(r"^nav:\s*$", text, re.MULTILINE)
    assert start is not None, "mkdocs.yml has no top-level nav: section"
    section = []
    for line in text[start.end():].splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            break  # the next top-level key
        section.append(line)
    return set(re.findall(r"([\w./-]+\.md)\b", "\n".join(section)))


def test_every_page_is_in_the_nav() -> None:
    pages = {p.name for p in DOCS.glob("*.md")}
    missing = sorted(pages - _nav_pages())
    assert not missing, f"docs pages missing from mkdocs.yml's nav: {missing}"


@pytest.mark.parametrize("page", CHECKED_PAGES)
def test_python_blocks_compile(page: str) -> None:
    blocks = _PYTHON_BLOCK.findall((DOCS / page).read_text())
    assert blocks, f"{page} has no ```python blocks"
    for i, code in enumerate(blocks):
        compile(code, f"{page}, python block {i + 1}", "exec")


@pytest.mark.parametrize("page", CHECKED_PAGES)
def test_cited_shardax_names_exist(page: str) -> None:
    names = sorted(set(_SX_NAME.findall((DOCS / page).read_text())))
    assert names, f"{page} cites no sx.* names"
    unresolved = []
    for dotted in names:
        obj = sx
        for part in dotted.strip(".").split("."):
            if not hasattr(obj, part):
                unresolved.append("sx" + dotted)
                break
            obj = getattr(obj, part)
    assert not unresolved, f"{page} cites names that shardax does not have: {unresolved}"
