"""MkDocs hook: render cudakit's docstrings (doctests, Sphinx roles) as good Markdown.

cudakit's docstrings are read by three audiences: ``help()``, pytest's doctests and this
site. Two of their conventions are not Markdown, so this hook adds a small Markdown
preprocessor (it applies to the pages and to the docstrings mkdocstrings renders, since
both use the site's Markdown extensions; code inside fences is left alone):

* a run of ``>>>`` doctest lines (up to the next blank line) is fenced as
  ```` ```pycon ````; Markdown would otherwise read it as nested block quotes;
* Sphinx roles become code: ``:func:`~cudakit.device.on_device``` links to the API
  reference entry (as ``on_device``), roles naming something outside cudakit become
  plain code spans;
* ``.. versionadded:: 0.1`` becomes "*Added in version 0.1.*";
* a reST literal block (a paragraph ending in ``::``, a blank line, an indented block)
  becomes a fenced block, ``python`` when it compiles and ``text`` otherwise, and the
  paragraph ends in one colon (``Example::`` -> ``Example:``; a lone or spaced ``::``
  disappears), as Sphinx renders it.

A third convention is not Markdown's but griffe's to read: fields and attributes are
documented by ``#:`` comments above them (Sphinx's autodoc convention), which griffe
ignores. :class:`CommentDocstrings`, a griffe extension that mkdocs.yml loads from this
file, makes those comments the attributes' docstrings, so a ``StepResult`` field is
described on the API page as in the source; an attribute set in a method
(``self.extra = self._parts.extras``) is shown without the expression that computes it.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path
from typing import Any

import griffe
from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor
from mkdocs.plugins import event_priority

_COMMENT_DOC = re.compile(r"^\s*#: ?(.*)$")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_ROLE = re.compile(r":(?:func|class|meth|attr|data|exc|mod|obj):`(~?)([\w.]+)(\(\))?`")
_VERSION = re.compile(r"^(\s*)\.\. version(added|changed):: *(\S+)\s*$")
# A paragraph line that introduces a reST literal block (not a ``.. directive::``).
_LITERAL = re.compile(r"^(?P<indent>\s*)(?!\.\. )(?P<text>.*?)(?P<space>\s?)::\s*$")


def _role(m: re.Match[str]) -> str:
    short, target, call = m.group(1), m.group(2), m.group(3) or ""
    shown = (target.rsplit(".", 1)[-1] if short else target) + call
    if target.startswith("cudakit."):
        return f"[`{shown}`][{target}]"
    return f"`{shown}`"


def _prose(line: str) -> str:
    v = _VERSION.match(line)
    if v:
        what = "Added" if v.group(2) == "added" else "Changed"
        return f"{v.group(1)}*{what} in version {v.group(3)}.*"
    return _ROLE.sub(_role, line) if ":`" in line else line


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _literal_block(lines: list[str], i: int) -> tuple[list[str], int] | None:
    """Fence the reST literal block introduced by ``lines[i]``; None if there is none.

    Returns the replacement lines and the index of the first line after the block.
    """
    m = _LITERAL.match(lines[i])
    if m is None or i + 1 >= len(lines) or lines[i + 1].strip():
        return None
    base = _indent(lines[i])
    j = i + 1
    while j < len(lines) and not lines[j].strip():
        j += 1
    end = j
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
        end += 1
    while end > j and not lines[end - 1].strip():
        end -= 1
    if end == j:  # no indented block follows
        return None
    indent = m["indent"]
    body = textwrap.dedent("\n".join(lines[j:end]))
    try:
        compile(body, "<docstring>", "exec")
        lang = "python"
    except SyntaxError:
        lang = "text"
    text = m["text"]
    head = [] if not text else [f"{indent}{text}" + ("" if m["space"] else ":")]
    block = [f"{indent}```{lang}", *(f"{indent}{ln}" if ln else "" for ln in body.split("\n"))]
    return [*(_prose(h) for h in head), "", *block, f"{indent}```"], end


class _DoctestFences(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        fence: str | None = None
        in_doctest = False
        indent = ""
        i = 0
        while i < len(lines):
            line = lines[i]
            i += 1
            if in_doctest:
                if line.strip():
                    out.append(line)
                    continue
                out.append(f"{indent}```")
                in_doctest = False
            m = _FENCE.match(line)
            if fence is not None:
                if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                    fence = None
                out.append(line)
            elif m:
                fence = m.group(1)
                out.append(line)
            elif (literal := _literal_block(lines, i - 1)) is not None:
                out.extend(literal[0])
                i = literal[1]
            elif line.lstrip().startswith(">>>"):
                indent = line[: len(line) - len(line.lstrip())]
                if out and out[-1].strip():
                    out.append("")
                out.extend([f"{indent}```pycon", line])
                in_doctest = True
            else:
                out.append(_prose(line))
        if in_doctest:
            out.append(f"{indent}```")
        return out


class DoctestFencesExtension(Extension):
    """Fence ``>>>`` doctest runs as ``pycon`` code before other preprocessors run."""

    def extendMarkdown(self, md: Markdown) -> None:
        # Before pymdownx.superfences' fenced-code preprocessor (priority 25+).
        md.preprocessors.register(_DoctestFences(md), "cudakit_doctest_fences", 40)


@event_priority(100)  # before mkdocstrings reads the Markdown extensions
def on_config(config: Any) -> Any:
    config.markdown_extensions.append(DoctestFencesExtension())
    return config


class CommentDocstrings(griffe.Extension):
    """griffe extension: the ``#:`` comment lines just above an attribute are its docstring."""

    def on_attribute_instance(
        self, *, node: Any, attr: griffe.Attribute, agent: Any, **kwargs: Any
    ) -> None:
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        if any(isinstance(t, ast.Attribute) for t in targets):
            attr.value = None  # ``self.x = <how __init__ computes it>``: no value to show
        if attr.docstring is not None or attr.lineno is None:
            return
        if not isinstance(attr.filepath, Path):
            return  # a namespace package's attribute, of several files: no source to read
        lines = attr.lines_collection[attr.filepath]
        found: list[str] = []
        i = attr.lineno - 2  # the line above, 0-based
        while i >= 0 and (m := _COMMENT_DOC.match(lines[i])):
            found.insert(0, m.group(1))
            i -= 1
        if found:
            attr.docstring = griffe.Docstring(
                "\n".join(found),
                lineno=i + 2,
                endlineno=attr.lineno - 1,
                parent=attr,
                parser=getattr(agent, "docstring_parser", None),
                parser_options=getattr(agent, "docstring_options", None),
            )
