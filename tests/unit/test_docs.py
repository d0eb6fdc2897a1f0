"""The documentation as a map: README.md stays a front page a newcomer reads in five minutes, and every relative
link in README.md and docs/*.md leads to a file that exists (and, with an #anchor, to a heading in it)."""
from __future__ import annotations

import pathlib
import re

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
PAGES = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]
README_LIMIT = 10_000  # characters
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (not '-' or '_'), spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' line in a code block is no heading
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def relative_links(page: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]  # no http:, mailto:


def test_readme_is_a_front_page():
    size = len(README.read_text())
    assert size <= README_LIMIT, (f"README.md is {size} characters, over {README_LIMIT}: move detail to a docs/ page "
                                  "and link it")
    assert "bash .ci/test" in README.read_text()  # CI runs the README's test command (.ci/run)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved.relative_to(REPO_ROOT) if REPO_ROOT in resolved.parents else resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading '#{anchor}' in {resolved.name}")
    assert broken == [], f"{page.name}: " + "; ".join(broken)


def test_the_link_check_sees_links():
    """The check reads every kind of link the pages use (it fails on a page with a broken one)."""
    page = REPO_ROOT / "docs" / "MEMORY.md"
    assert "BENCHMARKS.md#planned-peaks-by-card" in relative_links(page)
    assert "docs/before_after.png" in relative_links(README)
    assert slug("## Reliability (issue 13)".lstrip("#")) == "reliability-issue-13"
