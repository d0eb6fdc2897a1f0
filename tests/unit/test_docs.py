"""The documentation as a map: README.md stays a front page a newcomer reads in five minutes; MEMORY.md,
ARCHITECTURE.md, DISTRIBUTED.md and BENCHMARKS.md stay maps (at most 15,000 bytes each: details go to a linked topic
page under docs/); BENCHMARKS.md and its topic pages (docs/benchmarks/) stay results pages (no dated or per-session
headings; each section names its machine, the versions, a date and the command that measures it again), and each
benchmark that writes its own section finds that section on the page it writes to; and every relative link in
README.md and docs/**/*.md leads to a file that exists (and, with an #anchor, to a heading in it)."""
from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]  # docs/ and its topic folders (docs/memory/, docs/architecture/, ...)
README_LIMIT = 10_000  # characters
MAPS = ["MEMORY.md", "ARCHITECTURE.md", "DISTRIBUTED.md", "BENCHMARKS.md"]
MAP_LIMIT = 15_000  # bytes
BENCHMARKS = DOCS / "BENCHMARKS.md"
RESULTS_PAGES = [BENCHMARKS, *sorted((DOCS / "benchmarks").glob("*.md"))]  # the map and its topic pages
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (not '-' or '_'), spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    """The page's heading anchors as GitHub makes them: a repeated heading gets -1, -2, ... after the first."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' line in a code block is no heading
    seen: dict[str, int] = {}
    out = set()
    for line in text.splitlines():
        if re.match(r"#{1,6} ", line):
            base = slug(line.lstrip("#"))
            out.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
    return out


def relative_links(page: pathlib.Path) -> list[str]:
    return relative_links_in(page.read_text())


def relative_links_in(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]  # no http:, mailto:


def page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(REPO_ROOT))


def diary_headings(text: str) -> list[str]:
    """Headings that tell a story instead of naming a question: a date (2026-11-27) or a session in them."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [line for line in text.splitlines()
            if re.match(r"#{1,6} ", line) and (re.search(r"\d{4}-\d{2}-\d{2}", line) or re.search(r"session", line, re.I))]


def sections_without_provenance(text: str) -> list[str]:
    """Each "## " results section must name its machine ("Machine:" / "machine:"), its versions ("Versions:"), a date
    (YYYY-MM-DD) and, on a line of its own, the command that measures it again ("Command:", "Commands:", "Dates and
    commands:")."""
    text = re.sub(r"```.*?```", "```", text, flags=re.S)
    missing = []
    for section in re.split(r"^(?=## )", text, flags=re.M)[1:]:
        heading = section.splitlines()[0]
        lacks = [what for what, pattern, flags in (
            ("machine", r"machine:", re.I),
            ("versions", r"versions:", re.I),
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


@pytest.mark.parametrize("page", RESULTS_PAGES, ids=[page_id(p) for p in RESULTS_PAGES])
def test_benchmarks_are_results_pages(page):
    text = page.read_text()
    assert diary_headings(text) == [], (f"{page_id(page)} keeps one current figure per question: name the question in "
                                        "the heading, not the date or the session (git history keeps those)")
    assert sections_without_provenance(text) == [], (f"each {page_id(page)} section names its machine, the versions, "
                                                      "a date and the command")


def test_benchmarks_links_every_topic_page():
    linked = {(BENCHMARKS.parent / target.partition("#")[0]).resolve() for target in relative_links(BENCHMARKS)}
    assert [page_id(p) for p in RESULTS_PAGES[1:] if p.resolve() not in linked] == []


def bench_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script, page", [("bench/bench_realsize.py", "realsize_cpu.md"),
                                          ("bench/bench_train_step.py", "cpu_step_time.md")])
def test_each_section_writer_finds_its_section(script, page, tmp_path):
    """`--write docs/benchmarks/<page>` replaces its section in place (heading to the end of its table): each heading
    the script writes is a line of that page, and writing the page's own section back changes nothing."""
    source, path = (REPO_ROOT / script).read_text(), DOCS / "benchmarks" / page
    assert f"--write docs/benchmarks/{page}" in source  # the usage line names the page
    headings = re.findall(r'"(#{2,3} [^"]+\(`' + re.escape(script) + r'`\))"', source)
    lines = path.read_text().splitlines()
    assert headings and [h for h in headings if h not in lines] == []
    assert set(headings).isdisjoint(BENCHMARKS.read_text().splitlines())  # a --write to the map appends, clobbers nothing
    write_section = bench_module("bench_train_step_for_docs", "bench/bench_train_step.py").write_section
    copy = tmp_path / page
    copy.write_text(path.read_text())
    for heading in headings:
        start = lines.index(heading)
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("|"))
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        write_section(copy, "\n".join(lines[start:end]) + "\n")
    assert copy.read_text() == path.read_text()


def test_the_gpu_kit_writes_its_own_page():
    """bench/gpu/report.py replaces the section between its markers on docs/benchmarks/gpu_kit.md; the picture it links
    lies beside that page, and device.sh hands that page to the suite."""
    report = bench_module("gpukit_report_for_docs", "bench/gpu/report.py")
    page = DOCS / "benchmarks" / "gpu_kit.md"
    text = page.read_text()
    assert text.count(report.BEGIN_MARK) == 1 and text.count(report.END) == 1
    assert report.BEGIN_MARK not in BENCHMARKS.read_text()
    section = report.section([])
    for target in relative_links_in(section):
        assert (page.parent / target.partition("#")[0]).exists(), target
    assert "cp docs/benchmarks/gpu_kit.md" in (REPO_ROOT / "bench" / "gpu" / "device.sh").read_text()


def test_the_link_check_sees_links():
    """The check reads every kind of link the pages use (it fails on a page with a broken one)."""
    page = REPO_ROOT / "docs" / "MEMORY.md"
    assert "benchmarks/planned_peaks.md#planned-peaks-by-card" in relative_links(page)
    assert "docs/before_after.png" in relative_links(README)
    assert slug("## Reliability (issue 13)".lstrip("#")) == "reliability-issue-13"
    assert (slug("## Real size on a CPU (`bench/bench_realsize.py`)".lstrip("#"))
            == "real-size-on-a-cpu-benchbench_realsizepy")
    assert "../benchmarks/planned_peaks.md#planned-peaks-by-card" in relative_links(DOCS / "memory" / "POLICY.md")
    assert DOCS / "memory" / "POLICY.md" in PAGES and DOCS / "benchmarks" / "gpu_kit.md" in PAGES


def test_repeated_headings_get_numbered_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n## Notes\n\n```\n## not a heading\n```\n\n## Notes\n")
    assert anchors(page) == {"top", "notes", "notes-1"}


def test_the_results_page_check_sees_diaries():
    """The BENCHMARKS.md rules fail on what the page used to hold."""
    story = ("# Benchmarks\n\n## Planned peaks by card\n\n- Machine: a CPU\n- Versions: torch 2\n- Date: 2026-11-27\n"
             "- Command: `x`\n\n### What the third GPU session found (2026-11-27 night, NVIDIA H200)\n\n"
             "## Full fine-tuning\n\ntext\n")
    assert diary_headings(story) == ["### What the third GPU session found (2026-11-27 night, NVIDIA H200)"]
    assert sections_without_provenance(story) == ["## Full fine-tuning (no machine, no versions, no date, no command)"]
    generated = ("## LoRA step (`bench/x.py`)\n\n- Date: 2026-11-21; machine: x86_64\n- Versions: Python 3.11.7\n"
                 "- Command: `python bench/x.py`\n")
    assert sections_without_provenance(generated) == []  # the form bench/bench_train_step.py writes
