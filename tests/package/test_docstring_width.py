"""Docstring code fits the width an API page shows without scrolling (80 characters).

The API pages render docstrings, and every code block in them (doctest examples with
their expected output, reST ``::`` literal blocks, Markdown indented blocks such as the
exception hierarchy in ``cudakit/exceptions.py``) is measured as the page shows it: the
block's own indentation removed. tests/docs/test_docs.py holds the width, measured in
headless Chromium, and the same check for the guide pages.
"""

from __future__ import annotations

import ast
import itertools
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import cudakit

#: Characters of code a page shows without scrolling (tests/docs/test_docs.py:WIDTH).
WIDTH = 80
PACKAGE = Path(cudakit.__file__).parent

# A paragraph line that introduces a reST literal block (not a ``.. directive::``),
# as scripts/mkdocs_hooks.py reads it.
_LITERAL = re.compile(r"^\s*(?!\.\. ).*::\s*$")
# A Google-style section header ("Args:", "Examples:"): what is indented under it is
# the section's content, not a code block.
_SECTION = re.compile(
    r"^\s*(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters"
    r"|Returns|Return|Yields|Yield|Receives|Raises|Exceptions|Warns|Warnings|Examples?"
    r"|Notes?|Attributes|Functions|Methods|Classes|Modules|References|See Also|Todo)\s*:\s*$"
)
# Box-drawing characters: a line that draws a tree or a table is code wherever it is.
_BOX = re.compile("[\u2500-\u257f]")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _clean(doc: str) -> list[str]:
    """``inspect.cleandoc`` that keeps every line, so an index is an offset in the file."""
    lines = doc.expandtabs().split("\n")
    margin = min((_indent(ln) for ln in lines[1:] if ln.strip()), default=0)
    return [lines[0].strip()] + [ln[margin:].rstrip() for ln in lines[1:]]


def _block_end(lines: list[str], start: int, base: int) -> int:
    """The index after the block that starts at ``lines[start]``, indented past ``base``."""
    end = start
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return end


def code_lines(doc: str) -> list[tuple[int, str]]:
    """Each line a docstring shows as code, as the page shows it, with its line index.

    A ``>>>`` run goes on to the next blank line (its expected output included) and loses
    the indentation of its first ``>>>``; a literal or indented block loses its common
    indentation; a line with box-drawing characters anywhere else loses its own.
    """
    lines = _clean(doc)
    out: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            strip = _indent(line)
            while i < len(lines) and lines[i].strip():
                out.append((i, lines[i][strip:]))
                i += 1
            continue
        # A literal block (after ``::``) or a Markdown indented block (4 spaces past the
        # paragraph above, not a section's content) after a blank line.
        nxt = i + 1
        while nxt < len(lines) and not lines[nxt].strip():
            nxt += 1
        if (
            line.strip()
            and nxt > i + 1
            and nxt < len(lines)
            and not lines[nxt].lstrip().startswith(">>>")
            and not _SECTION.match(line)
            and (
                (_LITERAL.match(line) and _indent(lines[nxt]) > _indent(line))
                or _indent(lines[nxt]) >= _indent(line) + 4
            )
        ):
            end = _block_end(lines, nxt, _indent(line))
            body = textwrap.dedent("\n".join(lines[nxt:end])).split("\n")
            out.extend((nxt + k, text) for k, text in enumerate(body) if text.strip())
            i = end
            continue
        if _BOX.search(line):
            out.append((i, line.strip()))
        i += 1
    return out


def docstrings(root: Path) -> Iterator[tuple[Path, int, str]]:
    """Each docstring under ``root`` an API page renders: file, first line, text.

    Module, class and function docstrings, and attribute docstrings: a string right
    after an assignment in a module or class body (griffe renders them; doctest does
    not run their examples).
    """
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(
                node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            ):
                continue
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield path, node.body[0].lineno, doc
            if isinstance(node, (ast.Module, ast.ClassDef)):
                for before, after in itertools.pairwise(node.body):
                    if (
                        isinstance(before, (ast.Assign, ast.AnnAssign))
                        and isinstance(after, ast.Expr)
                        and isinstance(after.value, ast.Constant)
                        and isinstance(after.value.value, str)
                    ):
                        yield path, after.lineno, after.value.value


def test_no_docstring_code_line_is_wider_than_the_page_shows() -> None:
    wide = sorted(
        (path.relative_to(PACKAGE.parent), first + index, len(text), text.strip()[:50])
        for path, first, doc in docstrings(PACKAGE)
        for index, text in code_lines(doc)
        if len(text) > WIDTH
    )
    assert not wide, (
        f"{len(wide)} docstring code lines are wider than {WIDTH} characters, the width an "
        "API page shows without scrolling; wrap them (`...` continuation lines, a comment "
        "on its own line, an expected output across lines):\n"
        + "\n".join(
            f"{path}:{line}: {width} characters: {text}..." for path, line, width, text in wide
        )
    )


def test_every_kind_of_code_block_is_measured() -> None:
    doc = """Summary line.

    Prose is not code, however long it runs on this line of the docstring, and it wraps.

    Args:
        x: an argument, also prose, that a page wraps however long its description runs.

    Examples:
        >>> call(1,
        ...      2)
        expected output

    A literal block::

        literal = 1

    The hierarchy:

        Base
        ├── Child
    Drawn in prose: └── too.
    """
    shown = [text for _, text in code_lines(doc)]
    assert shown == [
        ">>> call(1,",
        "...      2)",
        "expected output",
        "literal = 1",
        "Base",
        "├── Child",
        "Drawn in prose: └── too.",
    ]


def test_each_code_line_is_named_by_its_line_in_the_file() -> None:
    misplaced = []
    for path, first, doc in docstrings(PACKAGE):
        source = path.read_text(encoding="utf-8").splitlines()
        for index, text in code_lines(doc):
            if text.strip() not in source[first + index - 1]:
                misplaced.append(f"{path.name}:{first + index}: {text.strip()[:50]}")
    assert not misplaced, "\n".join(misplaced)
