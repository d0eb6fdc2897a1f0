"""The documentation as a map: README.md stays a front page a newcomer reads in five minutes; MEMORY.md,
ARCHITECTURE.md and DISTRIBUTED.md stay maps (at most 15,000 bytes each: details go to a linked topic page under
docs/); BENCHMARKS.md stays a results page (no dated or per-session headings; each section names its machine, a date
and the command that measures it again); and every relative link in README.md and docs/**/*.md leads to a file that
exists (and, with an #anchor, to a heading in it)."""
from __future__ import annotations

import pathlib
import re

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]  # docs/ and its topic folders (docs/memory/, docs/architecture/, ...)
README_LIMIT = 10_000  # characters
MAPS = ["MEMORY.md", "ARCHITECTURE.md", "DISTRIBUTED.md"]
MAP_LIMIT = 15_000  # bytes
BENCHMARKS = DOCS / "BENCHMARKS.md"
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


def page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(REPO_ROOT))


def diary_headings(text: str) -> list[str]:
    """Headings that tell a story instead of naming a question: a date (2026-11-27) or a session in them."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [line for line in text.splitlines()
            if re.match(r"#{1,6} ", line) and (re.search(r"\d{4}-\d{2}-\d{2}", line) or re.search(r"session", line, re.I))]


def sections_without_provenance(text: str) -> list[str]:
    """Each "## " results section must name its machine ("Machine:" / "machine:"), a date (YYYY-MM-DD) and, on a line
    of its own, the command that measures it again ("Command:", "Commands:", "Dates and commands:")."""
    text = re.sub(r"```.*?```", "```", text, flags=re.S)
    missing = []
    for section in re.split(r"^(?=## )", text, flags=re.M)[1:]:
        heading = section.splitlines()[0]
        lacks = [what for what, pattern, flags in (
            ("machine", r"machine:", re.I),
            ("date", r"\b\d{4}-\d{2}-\d{2}\b", 0),
            ("command", r"^\s*(- )?(\w+ and )?commands?:", re.I | re.M)) if not re.search(pattern, section, flags)]
        if lacks:
            missing.append(f"{heading} (no {', no '.join(lacks)})")
    return missing


def test_readme_is_a_front_page():
    size = len(README.read_text())
    assert size <= README_LIMIT, (f"README.md is {size} characters, over {README_LIMIT}: move detail to a docs/ page "
                                  "and link it")
    assert "bash .ci/test" in README.read_text()  # CI runs the README's test command (.ci/run)


@pytest.mark.parametrize("page", PAGES, ids=[page_id(p) for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved.relative_to(REPO_ROOT) if REPO_ROOT in resolved.parents else resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading '#{anchor}' in {resolved.name}")
    assert broken == [], f"{page_id(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("name", MAPS)
def test_map_pages_stay_maps(name):
    size = len((DOCS / name).read_bytes())
    assert size <= MAP_LIMIT, (f"docs/{name} is {size} bytes, over {MAP_LIMIT}: it is a map (what exists, where it lives "
                               "in the code, a link to the details); move the detail to its topic page and link it")


def test_benchmarks_is_a_results_page():
    text = BENCHMARKS.read_text()
    assert diary_headings(text) == [], ("BENCHMARKS.md keeps one current figure per question: name the question in the "
                                        "heading, not the date or the session (git history keeps those)")
    assert sections_without_provenance(text) == [], "each BENCHMARKS.md section names its machine, a date and the command"


def test_the_link_check_sees_links():
    """The check reads every kind of link the pages use (it fails on a page with a broken one)."""
    page = REPO_ROOT / "docs" / "MEMORY.md"
    assert "BENCHMARKS.md#planned-peaks-by-card" in relative_links(page)
    assert "docs/before_after.png" in relative_links(README)
    assert slug("## Reliability (issue 13)".lstrip("#")) == "reliability-issue-13"
    assert "../BENCHMARKS.md#planned-peaks-by-card" in relative_links(DOCS / "memory" / "POLICY.md")  # a subfolder's
    assert DOCS / "memory" / "POLICY.md" in PAGES


def test_the_results_page_check_sees_diaries():
    """The BENCHMARKS.md rules fail on what the page used to hold."""
    story = ("# Benchmarks\n\n## Planned peaks by card\n\n- Machine: a CPU\n- Date: 2026-11-27\n- Command: `x`\n\n"
             "### What the third GPU session found (2026-11-27 night, NVIDIA H200)\n\n## Full fine-tuning\n\ntext\n")
    assert diary_headings(story) == ["### What the third GPU session found (2026-11-27 night, NVIDIA H200)"]
    assert sections_without_provenance(story) == ["## Full fine-tuning (no machine, no date, no command)"]
    generated = "## LoRA step (`bench/x.py`)\n\n- Date: 2026-11-21; machine: x86_64\n- Command: `python bench/x.py`\n"
    assert sections_without_provenance(generated) == []  # the form bench/bench_train_step.py writes
