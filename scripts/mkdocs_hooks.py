"""MkDocs hook: render ``>>>`` doctest examples in docstrings as ``pycon`` code blocks.

cudakit's docstrings put a runnable ``>>>`` example right after the summary line (the
doctests pytest runs). Markdown would read those lines as nested block quotes, so
this hook adds a small Markdown preprocessor that fences every run of doctest lines
(from a ``>>>`` line to the next blank line) as ```` ```pycon ````. It applies to the
pages and to the docstrings mkdocstrings renders, since both use the site's Markdown
extensions. Code already inside a fence is left alone.
"""

from __future__ import annotations

import re
from typing import Any

from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor
from mkdocs.plugins import event_priority

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


class _DoctestFences(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        fence: str | None = None
        in_doctest = False
        indent = ""
        for line in lines:
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
            elif line.lstrip().startswith(">>>"):
                indent = line[: len(line) - len(line.lstrip())]
                if out and out[-1].strip():
                    out.append("")
                out.extend([f"{indent}```pycon", line])
                in_doctest = True
            else:
                out.append(line)
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
