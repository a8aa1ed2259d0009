"""Every code example in ``docs/`` runs on CPU, as a reader pastes it.

Each fenced ```` ```python ```` (or ```` ```py ````) block runs **on its own**, in a
fresh namespace with the working directory set to a temporary folder: a reader can
paste any block into a file and run it. A block that continues an earlier one says so
in its title, which the site shows above the code::

    ```python title="train.py"
    ...
    ```
    ```python title="train.py (continued)"
    ...
    ```

Blocks with the same title, the later ones ending in `` (continued)``, run in order in
one namespace, like one script. ```` ```pycon ```` blocks (``>>>`` prompts) are checked
as doctests, alone or continuing a titled block the same way. Examples that need a GPU
or ``torchrun`` belong in ```` ```bash ```` or ```` ```text ```` fences, which are shown
but not run.

No code line on a page is wider than the page shows without scrolling (``WIDTH``).

Tracebacks point at the Markdown file and line, because every block is compiled
with the page as its file name and padded to its real line number.
"""

from __future__ import annotations

import doctest
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

DOCS = Path(__file__).resolve().parents[2] / "docs"

# An opening fence: up to any indentation (blocks inside admonitions and tabs are
# indented), three or more backticks or tildes, then the info string.
_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
_RUN_LANGS = {"python": "python", "py": "python", "pycon": "pycon"}


@dataclass(frozen=True)
class Block:
    """One fenced code block that the docs test runs."""

    lang: str  # "python" or "pycon"
    source: str  # dedented code
    line: int  # 1-based line of the first code line in the page
    title: str = ""  # the fence's title="...", if any

    @property
    def script(self) -> str:
        """The script the block belongs to: its title without `` (continued)``."""
        return self.title.removesuffix(CONTINUED)

    @property
    def continues(self) -> bool:
        return self.title.endswith(CONTINUED)


CONTINUED = " (continued)"
_TITLE = re.compile(r"""\btitle=(?:"([^"]*)"|'([^']*)')""")


def extract_blocks(text: str, page: str = "<page>") -> list[Block]:
    """Return the runnable fenced blocks of a Markdown page, in order.

    Raises:
        ValueError: a fence is opened and never closed (the page renders wrongly too).
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        # The language is the first word of the info string; attributes such as
        # ``{.python title="x"}`` or ``python title="x"`` are allowed.
        info = m["info"].strip().lstrip("{").lstrip(".")
        lang = re.split(r"[\s{}]", info, maxsplit=1)[0].lower() if info else ""
        start = i + 1
        j = start
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if j == len(lines):
            raise ValueError(
                f"{page}:{i + 1}: the code fence {fence}{m['info']} is never closed; "
                f"add a closing {fence} line."
            )
        if lang in _RUN_LANGS:
            body = [
                ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[start:j]
            ]
            title = _TITLE.search(m["info"])
            name = (title[1] if title[1] is not None else title[2]) if title else ""
            blocks.append(Block(_RUN_LANGS[lang], "\n".join(body) + "\n", start + 1, name))
        i = j + 1
    return blocks


def scripts(blocks: list[Block], page: str = "<page>") -> list[list[Block]]:
    """Group ``blocks`` into what runs together: each block alone, or a titled script.

    Raises:
        ValueError: a `` (continued)`` block names no earlier block of the page, or two
            blocks start a script of the same title (the reader could not tell which
            one a later block continues).
    """
    groups: list[list[Block]] = []
    named: dict[str, list[Block]] = {}
    for block in blocks:
        if block.continues:
            if block.script not in named:
                raise ValueError(
                    f"{page}:{block.line}: the block titled {block.title!r} continues "
                    f"{block.script!r}, and no earlier block of the page has that title; "
                    f'title the block it continues title="{block.script}".'
                )
            named[block.script].append(block)
        else:
            if block.title in named and block.lang == "python":
                first = named[block.title][0].line
                raise ValueError(
                    f"{page}:{block.line}: a second script titled {block.title!r} (the first "
                    f"starts at line {first}); give each script its own title, or title this "
                    f'block "{block.title}{CONTINUED}" if it continues the first.'
                )
            groups.append([block])
            if block.title:
                named[block.title] = groups[-1]
    return groups


def run_script(blocks: list[Block], path: Path) -> None:
    """Run ``blocks`` in order in one fresh namespace, as ``python page.py`` would."""
    # A real module, as a script run by `python page.py` has (torch.compile looks the
    # functions' module up in sys.modules).
    module = types.ModuleType("__docs__")
    module.__file__ = str(path)
    sys.modules["__docs__"] = module
    try:
        _run_blocks(blocks, module.__dict__, path)
    finally:
        sys.modules.pop("__docs__", None)


def run_page(path: Path) -> int:
    """Run every runnable block of ``path``, each alone or with its script; return how many."""
    blocks = extract_blocks(path.read_text(encoding="utf-8"), str(path))
    for group in scripts(blocks, str(path)):
        run_script(group, path)
    return len(blocks)


def _run_blocks(blocks: list[Block], namespace: dict[str, Any], path: Path) -> None:
    for block in blocks:
        if block.lang == "python":
            padded = "\n" * (block.line - 1) + block.source
            exec(compile(padded, str(path), "exec"), namespace)
        else:
            test = doctest.DocTestParser().get_doctest(
                block.source, namespace, f"{path.name}:{block.line}", str(path), block.line - 1
            )
            runner = doctest.DocTestRunner(
                optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
            )
            out: list[str] = []
            runner.run(test, out=out.append, clear_globs=False)
            if runner.summarize(verbose=False).failed:
                pytest.fail("".join(out), pytrace=False)


PAGES = sorted(DOCS.glob("*.md"))


def _cases() -> list[Any]:
    cases = []
    for page in PAGES:
        blocks = extract_blocks(page.read_text(encoding="utf-8"), str(page))
        for group in scripts(blocks, str(page)):
            name = group[0].title or f"line {group[0].line}"
            cases.append(pytest.param(page, group, id=f"{page.name}:{name}"))
    return cases


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Temp working directory; torch's global state and logging restored after the block."""
    import logging

    monkeypatch.chdir(tmp_path)
    rng = torch.get_rng_state()
    dtype = torch.get_default_dtype()
    grad = torch.is_grad_enabled()
    threads = torch.get_num_threads()
    # A page that shows how to see cudakit's log lines sets levels and adds handlers.
    loggers = [logging.getLogger(), logging.getLogger("cudakit")]
    saved = [(lg, lg.level, list(lg.handlers), lg.propagate) for lg in loggers]
    try:
        yield tmp_path
    finally:
        torch.set_rng_state(rng)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.set_num_threads(threads)
        for lg, level, handlers, propagate in saved:
            for h in lg.handlers:
                if h not in handlers:
                    h.close()
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate = propagate


@pytest.mark.parametrize(("page", "blocks"), _cases())
def test_each_block_runs_alone_or_with_the_block_it_continues(
    page: Path, blocks: list[Block], isolated: Path
) -> None:
    run_script(blocks, page)


_MAIN = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.M)


def _launched_cases() -> list[Any]:
    """Titled scripts behind a ``__main__`` guard: in-process they only define things."""
    cases = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for group in scripts(extract_blocks(text, str(page)), str(page)):
            title = group[0].title
            if title and group[0].lang == "python" and any(_MAIN.search(b.source) for b in group):
                torchrun = re.search(rf"torchrun [^\n`]*\b{re.escape(title)}\b", text) is not None
                cases.append(pytest.param(page, group, torchrun, id=f"{page.name}:{title}"))
    return cases


@pytest.mark.distributed
@pytest.mark.parametrize(("page", "blocks", "torchrun"), _launched_cases())
def test_scripts_with_a_main_guard_run_as_the_page_says(
    page: Path, blocks: list[Block], torchrun: bool, tmp_path: Path
) -> None:
    """Written to a file under its title and run: with ``torchrun --nproc-per-node 2`` when
    the page runs it so (on the CPU: gloo), else with ``python`` (``launch()`` scripts)."""
    import os
    import subprocess

    title = blocks[0].title
    (tmp_path / title).write_text("".join(b.source for b in blocks), encoding="utf-8")
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command = [sys.executable, *(launcher if torchrun else []), title]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, f"{page.name}: {' '.join(command[1:])}\n{proc.stdout}{proc.stderr}"


#: Characters of code a page shows without scrolling: at 1280 px, beside both sidebars,
#: a code block is 688 px wide in headless Chromium (656 px inside its padding), 80
#: characters of 13.6 px Roboto Mono; no code block of the built guide pages scrolls
#: sideways at this width (docs/ruff.toml formats Python to it).
WIDTH = 80
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})")


def code_lines(text: str) -> list[tuple[int, str]]:
    """Every line inside a fenced block of any language, dedented, with its line number."""
    out: list[tuple[int, str]] = []
    fence = indent = ""
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if not fence and m:
            fence, indent = m["fence"], m["indent"]
        elif fence and m and m["fence"].startswith(fence) and not line.strip(" \t`~"):
            fence = ""
        elif fence:
            out.append((number, line.removeprefix(indent)))
    return out


def test_no_code_line_is_wider_than_the_page_shows() -> None:
    wide = [
        f"{page.relative_to(DOCS)}:{number}: {len(line)} characters: {line.strip()[:50]}..."
        for page in sorted(DOCS.rglob("*.md"))
        for number, line in code_lines(page.read_text(encoding="utf-8"))
        if len(line.rstrip()) > WIDTH
    ]
    assert not wide, (
        f"{len(wide)} code lines are wider than {WIDTH} characters, the width a page shows "
        "without scrolling; wrap them (`ruff format docs` wraps Python):\n" + "\n".join(wide)
    )


def test_two_scripts_of_one_title_are_refused() -> None:
    text = '```python title="a.py"\nx = 1\n```\n\n```python title="a.py"\ny = 2\n```\n'
    with pytest.raises(ValueError, match=r"p.md:6: a second script titled 'a.py' .* line 2"):
        scripts(extract_blocks(text, "p.md"), "p.md")


def test_a_continued_block_names_an_earlier_block() -> None:
    text = '```python title="a.py"\nx = 1\n```\n\n```python title="b.py (continued)"\ny = x\n```\n'
    with pytest.raises(ValueError, match=r"p.md:6: .* continues 'b.py', and no earlier block"):
        scripts(extract_blocks(text, "p.md"), "p.md")


def test_blocks_run_alone_unless_titled_as_continuing(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    script = (
        '```python title="t.py"\na = 2\n```\n\n'
        '```pycon title="t.py (continued)"\n>>> a * 21\n42\n```\n'
    )
    page.write_text(script)
    assert run_page(page) == 2
    page.write_text(script + "\n```python\nb = a\n```\n")
    with pytest.raises(NameError, match="'a' is not defined"):
        run_page(page)


def test_code_lines_include_every_language_and_skip_prose() -> None:
    text = "prose " * 40 + "\n\n!!! note\n    ```bash\n    pip install x\n    ```\n"
    assert code_lines(text) == [(5, "pip install x")]


# -- the extractor itself ----------------------------------------------------------


def test_extracts_python_blocks_in_order_with_line_numbers() -> None:
    text = "# T\n\n```python\nx = 1\n```\n\n```bash\nrm -rf /\n```\n\n```py\ny = x + 1\n```\n"
    blocks = extract_blocks(text)
    assert [b.source for b in blocks] == ["x = 1\n", "y = x + 1\n"]
    assert [b.line for b in blocks] == [4, 12]


def test_indented_blocks_in_admonitions_and_attributes() -> None:
    text = '!!! note\n    ```python title="a.py"\n    if True:\n        z = 3\n    ```\n'
    (block,) = extract_blocks(text)
    assert block.source == "if True:\n    z = 3\n"
    assert block.line == 3


def test_longer_fences_and_tildes_nest() -> None:
    text = "````markdown\n```python\nnot run\n```\n````\n~~~python\nrun = True\n~~~\n"
    assert [b.source for b in extract_blocks(text)] == ["run = True\n"]


def test_pycon_blocks_are_doctests(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("```pycon\n>>> a = 2\n>>> a * 21\n42\n```\n")
    assert run_page(page) == 1
    page.write_text("```pycon\n>>> 1 + 1\n3\n```\n")
    with pytest.raises(pytest.fail.Exception, match="Expected:\n    3\nGot:\n    2"):
        run_page(page)


def test_unclosed_fence_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"page.md:2: the code fence ```python is never closed"):
        extract_blocks("text\n```python\nx = 1\n", "page.md")


def test_errors_point_at_the_markdown_line(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# t\n\n```python\nok = 1\nraise KeyError('boom')\n```\n")
    with pytest.raises(KeyError) as info:
        run_page(page)
    frame = info.traceback[-1]
    assert Path(str(frame.path)) == page
    assert frame.lineno + 1 == 5


# -- the site ----------------------------------------------------------------------

ROOT = DOCS.parent


def test_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: every page in the nav exists, links and API refs resolve.

    Not ``-q``: quiet mode drops warnings before strict mode counts them, so a build that
    CI's plain ``mkdocs build --strict`` fails would pass here.
    """
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason='the "docs" extra: pip install -e ".[docs]"')
    import os
    import subprocess
    import sys

    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "WARNING" not in log, log
    assert (tmp_path / "site" / "api" / "index.html").exists()


def _hooks() -> Any:
    pytest.importorskip("mkdocs", reason='the "docs" extra: pip install -e ".[docs]"')
    import importlib.util

    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts/mkdocs_hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hook_fences_doctests_and_converts_roles() -> None:
    hooks = _hooks()
    lines = [
        "Move it with :func:`~cudakit.device.on_device`, like :meth:`torch.Tensor.to`.",
        "",
        ">>> x = 1",
        "... # continued",
        "1",
        "",
        "```python",
        ">>> untouched = True",
        "```",
        "    .. versionadded:: 0.1",
    ]
    out = hooks._DoctestFences(None).run(lines)
    assert out == [
        "Move it with [`on_device`][cudakit.device.on_device], like `torch.Tensor.to`.",
        "",
        "```pycon",
        ">>> x = 1",
        "... # continued",
        "1",
        "```",
        "",
        "```python",
        ">>> untouched = True",
        "```",
        "    *Added in version 0.1.*",
    ]


def test_hook_closes_a_doctest_at_the_end_and_keeps_its_indent() -> None:
    hooks = _hooks()
    assert hooks._DoctestFences(None).run(["text", "    >>> 1 + 1", "    2"]) == [
        "text",
        "",
        "    ```pycon",
        "    >>> 1 + 1",
        "    2",
        "    ```",
    ]


def test_hook_fences_rest_literal_blocks() -> None:
    """``text::`` plus an indented block renders as a fenced block after ``text:``."""
    hooks = _hooks()
    lines = [
        "As a decorator over the function that computes the",
        "loss::",
        "",
        "    @step",
        "    def f(x):",
        "        return x",
        "",
        "    result = f(1)",
        "",
        "A tree ::",
        "",
        "    A",
        "    └── B(ValueError)",
        "",
        "After, with :func:`~cudakit.data.prefetch`.",
        ".. versionadded:: 0.1",
    ]
    assert hooks._DoctestFences(None).run(lines) == [
        "As a decorator over the function that computes the",
        "loss:",
        "",
        "```python",
        "@step",
        "def f(x):",
        "    return x",
        "",
        "result = f(1)",
        "```",
        "",
        "A tree",
        "",
        "```text",
        "A",
        "└── B(ValueError)",
        "```",
        "",
        "After, with [`prefetch`][cudakit.data.prefetch].",
        "*Added in version 0.1.*",
    ]


def test_hook_leaves_a_double_colon_without_a_block_alone() -> None:
    hooks = _hooks()
    lines = ["Ends in a colon::", "not indented, so no literal block"]
    assert hooks._DoctestFences(None).run(lines) == lines
