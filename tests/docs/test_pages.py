"""The shape of the guide pages and of the changelog: short, each thing said once.

Every guide page opens with what it is for and one example, before its first ``##``
section; no paragraph runs over 150 words; CHANGELOG.md has one line per change, and
the detail lives on the pages.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

#: The guide pages: docs/*.md but the API pages and those that include a file of the
#: repository root (changelog.md, architecture.md), which is checked itself.
GUIDE = sorted(
    p for p in DOCS.glob("*.md") if not p.read_text(encoding="utf-8").startswith("--8<--")
)
PAGES = [*GUIDE, ROOT / "ARCHITECTURE.md"]

MAX_PARAGRAPH_WORDS = 150
#: The guide pages' words in all, counted as ``wc -w`` counts (whitespace-separated
#: tokens). Issue 33 aims at 24,000; this is where the cut of 2026-12 left them (from
#: 32,554), and it only goes down: a page that grows cuts repetition elsewhere.
MAX_GUIDE_WORDS = 24_900
_FENCED = re.compile(r"^([ \t]*)(`{3,}|~{3,}).*?^\1\2[ \t]*$", re.S | re.M)


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a Markdown page: code blocks, tables and headings left out,
    each item of a list a paragraph of its own."""
    prose = _FENCED.sub("", text)
    out = []
    for block in re.split(r"\n[ \t]*\n", prose):
        lines = [ln for ln in block.splitlines() if not ln.lstrip().startswith(("|", "#"))]
        for item in re.split(r"\n(?=[-*] |\d+\. )", "\n".join(lines)):
            if item.strip():
                out.append(item)
    return out


def opening(text: str) -> str:
    """What a page shows before its first ``##`` section."""
    return re.split(r"^## ", text, maxsplit=1, flags=re.M)[0]


def test_paragraphs_are_split_around_code_tables_and_headings() -> None:
    text = "# T\n\nOne two.\n\n```python\nx = 1\n\ny = 2\n```\n\n| a |\n|---|\n\nThree.\n"
    assert paragraphs(text) == ["One two.", "Three."]
    assert paragraphs("Four:\n- five\n  six\n- seven\n1. eight\n") == [
        "Four:",
        "- five\n  six",
        "- seven",
        "1. eight",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_paragraph_is_longer_than_150_words(page: Path) -> None:
    long = [
        f"{len(p.split())} words: {p[:60]!r}..."
        for p in paragraphs(page.read_text(encoding="utf-8"))
        if len(p.split()) > MAX_PARAGRAPH_WORDS
    ]
    assert not long, f"{page.name}: split or shorten these paragraphs:\n" + "\n".join(long)


@pytest.mark.parametrize("page", GUIDE, ids=lambda p: p.name)
def test_each_page_opens_with_its_purpose_and_an_example(page: Path) -> None:
    """Before the first ``##``: the title, a sentence of what the page is for, a code block."""
    head = opening(page.read_text(encoding="utf-8"))
    assert head.startswith("# "), f"{page.name}: starts without a title"
    assert paragraphs(head), f"{page.name}: say what the page is for under its title"
    assert re.search(r"^[ \t]*(`{3,}|~{3,})", head, re.M), (
        f"{page.name}: show one example before the first ## section"
    )


def test_the_guide_pages_stay_short() -> None:
    """Each thing said once: a page links to another instead of repeating it."""
    words = {p.name: len(p.read_text(encoding="utf-8").split()) for p in GUIDE}
    largest = ", ".join(f"{n} {w:,}" for n, w in sorted(words.items(), key=lambda i: -i[1])[:5])
    total = sum(words.values())
    assert total <= MAX_GUIDE_WORDS, (
        f"the guide pages hold {total:,} words, over {MAX_GUIDE_WORDS:,}; cut repetition "
        f"from the largest: {largest}"
    )


def test_the_home_page_counts_the_utilities_it_lists() -> None:
    text = (DOCS / "index.md").read_text(encoding="utf-8")
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    said = re.search(r"\b(\w+) composable utilities", text)
    assert said is not None
    table = opening(text).split("| utility |", 1)[1].split("\n\n", 1)[0]
    rows = [ln for ln in table.splitlines()[2:] if ln.startswith("| ")]
    assert words.index(said[1]) + 1 == len(rows), f"says {said[1]}, lists {len(rows)}"


# -- the changelog -----------------------------------------------------------------


def _changelog() -> str:
    return (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def test_changelog_follows_keep_a_changelog() -> None:
    text = _changelog()
    releases = re.findall(r"^## (.+)$", text, re.M)
    assert releases[0] == "[Unreleased]"
    for section in re.findall(r"^### (.+)$", text, re.M):
        assert section in {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def test_changelog_has_one_short_line_per_change() -> None:
    """The how and the edge cases go on the pages; a release is read in a minute."""
    text = _changelog()
    entries = re.findall(r"^- (.*)$", text, re.M)
    assert entries
    continued = re.findall(r"^[ \t]+\S.*$", text.split("## [Unreleased]", 1)[1], re.M)
    assert not continued, f"an entry runs over several lines: {continued[0]!r}"
    lengths = [len(e) for e in entries]
    assert statistics.median(lengths) <= 160, statistics.median(lengths)
    longest = max(entries, key=len)
    assert len(longest) <= 400, longest


def test_changelog_cites_no_test_paths() -> None:
    assert not re.search(r"\btests/", _changelog())
