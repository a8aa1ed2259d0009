"""The documentation site as a reader sees it: built once, strictly, then read as HTML.

The site is built once per test run (``mkdocs build --strict`` into a temporary folder,
a few seconds); every test here reads that build. Marked ``docs``: deselect with
``-m "not docs"``. Skipped without the ``docs`` extra.
"""

from __future__ import annotations

import html
import importlib
import importlib.util
import os
import pkgutil
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FIGURES = DOCS / "figures"

pytestmark = pytest.mark.docs

API_PAGES = ("device", "precision", "memory", "parallel", "data", "checkpoint", "other")


class Site:
    def __init__(self, root: Path, log: str) -> None:
        self.root = root
        self.log = log

    def pages(self) -> list[Path]:
        return sorted(self.root.rglob("*.html"))

    def text(self, page: Path) -> str:
        return page.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason='the "docs" extra: pip install -e ".[docs]"')
    out = tmp_path_factory.mktemp("site") / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "WARNING" not in log, log
    return Site(out, log)


def _plain(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment)).strip()


# -- the API reference --------------------------------------------------------------


def test_signatures_are_formatted(site: Site) -> None:
    """Black or Ruff is found, so long signatures wrap instead of staying one line."""
    assert "Formatting signatures requires" not in site.log
    longest = 0
    for name in API_PAGES:
        page = site.text(site.root / "api" / name / "index.html")
        for block in re.findall(r'<div class="doc-signature highlight">(.*?)</div>', page, re.S):
            code = re.sub(r'<a id="[^"]*" name="[^"]*" href="[^"]*"></a>', "", block)
            longest = max(longest, *(len(ln) for ln in _plain(code).splitlines()))
    assert 0 < longest <= 100, f"a signature line of {longest} characters: not formatted"


def _api_objects(site: Site) -> list[tuple[str, list[str]]]:
    """(object id, its signature blocks as plain text) for every object on the API pages.

    An object's signatures are rendered between its heading and its contents.
    """
    found = []
    for name in API_PAGES:
        page = site.text(site.root / "api" / name / "index.html")
        for m in re.finditer(
            r'<h\d id="(cudakit\.[\w.]+)" class="doc doc-heading">(.*?)'
            r'<div class="doc doc-contents',
            page,
            re.S,
        ):
            blocks = re.findall(
                r'<div class="doc-signature highlight">(.*?)</div>', m.group(2), re.S
            )
            found.append((m.group(1), [_plain(b) for b in blocks]))
    return found


def _private_names(text: str) -> set[str]:
    """Identifiers a user cannot import: each part that starts with "_" and is no dunder."""
    return {n for n in re.findall(r"(?<!\w)_\w+", text) if not re.fullmatch(r"__\w+__", n)}


def test_private_names_finds_what_it_should() -> None:
    found = _private_names("x: _Keep = _KEEP, y: cudakit._output.Stderr, z: __Mangled = 1_000")
    assert found == {"_Keep", "_KEEP", "_output", "__Mangled"}
    assert not _private_names("__init__(self, some_name: int = 1_000) -> SearchDecorator")


def test_no_signature_shows_a_private_name(site: Site) -> None:
    """A signature names only what a user can import and read about: no ``_Private`` types."""
    objects = _api_objects(site)
    assert len(objects) > 100
    bad = {f"{obj}: {n}" for obj, blocks in objects for b in blocks for n in _private_names(b)}
    assert not bad, "; ".join(sorted(bad))


def _cudakit_definitions() -> set[str]:
    """Names that cudakit's modules define at top level: classes, aliases, constants."""
    pattern = re.compile(r"^(?:class\s+)?([A-Za-z]\w*)\b(?:\s*[(:]|\s*=(?!=))", re.M)
    names: set[str] = set()
    for path in (ROOT / "cudakit").rglob("*.py"):
        names |= set(pattern.findall(path.read_text(encoding="utf-8")))
    return names


def test_every_cudakit_type_in_a_signature_is_described(site: Site) -> None:
    """A type or default a signature names (``LogTarget``, ``STDERR``) is on an API page too."""
    objects = _api_objects(site)
    described = {obj.rsplit(".", 1)[1] for obj, _ in objects}
    ours = _cudakit_definitions()
    # Type variables (T, P, T_co) are read as such, not looked up.
    named = {
        n
        for _, blocks in objects
        for b in blocks
        for n in re.findall(r"\b[A-Z]\w*", b)
        if not re.fullmatch(r"[A-Z](_co|_contra)?", n)
    }
    missing = sorted((named & ours) - described)
    assert not missing, f"named in signatures, described on no API page: {missing}"


def test_every_api_object_shows_one_signature(site: Site) -> None:
    """Overloads are described in the docstring; the page shows one signature, then the text."""
    counts = {obj: len(blocks) for obj, blocks in _api_objects(site)}
    assert counts["cudakit.device.on_device"] == 1
    assert counts["cudakit.data.prefetch"] == 1
    assert not {obj: n for obj, n in counts.items() if n > 1}


def test_module_intros_name_no_internal_module(site: Site) -> None:
    """A module's intro says what it offers, not how its files are laid out."""
    bad = []
    intros = 0
    for name in API_PAGES:
        page = site.text(site.root / "api" / name / "index.html")
        for m in re.finditer(
            r'<div class="doc doc-object doc-module">\s*<a id="(cudakit[\w.]*)"></a>(.*?)'
            r'<div class="doc doc-children">',
            page,
            re.S,
        ):
            intros += 1
            module = importlib.import_module(m.group(1))
            inner = {i.name for i in pkgutil.iter_modules(getattr(module, "__path__", []))}
            internal = inner - set(getattr(module, "__all__", ()))
            spans = set(re.findall(r"<code>([\w.]+)</code>", m.group(2)))
            named = sorted(internal & spans) + sorted(_private_names(_plain(m.group(2))))
            if named:
                bad.append(f"{m.group(1)}: {', '.join(named)}")
    assert intros >= 8
    assert not bad, bad


def test_fields_documented_by_comments_are_described(site: Site) -> None:
    """``#:`` comments above fields (Sphinx's convention) are their docs on the API pages."""
    described = {}
    for name in API_PAGES:
        page = site.text(site.root / "api" / name / "index.html")
        for m in re.finditer(
            r'<h\d id="(cudakit\.[\w.]+)" class="doc doc-heading">.*?'
            r'<div class="doc doc-contents ?[^"]*">(.*?)</div>',
            page,
            re.S,
        ):
            described[m.group(1)] = re.sub(r"\s+", " ", _plain(m.group(2)))
    for field, words in {
        "cudakit.amp.StepResult.stepped": "True when the optimizer really updated the weights",
        "cudakit.parallel.LoadResult.missing_keys": "The model's keys that the state dict",
        "cudakit.speed.DevicePeak.tflops": "Dense TFLOP/s per dtype key",
    }.items():
        assert field in described, f"{field} is not on the API pages"
        assert words in described[field], f"{field}: {described[field][:200]!r}"


def _is_public(path: str) -> bool:
    """A cudakit path a user can import: no private part, exported by its package."""
    parts = path.split(".")
    if parts[0] != "cudakit":
        return True  # typing.Protocol, torch.utils.data.DataLoader, ValueError
    if _private_names(path):
        return False
    obj = getattr(importlib.import_module(".".join(parts[:-1])), parts[-1], None)
    if type(obj).__name__ in ("TypeVar", "ParamSpec"):
        return True  # a type parameter: Generic[T], Protocol[P, R_co]
    package = importlib.import_module(".".join(parts[:2]))
    return parts[-1] in getattr(package, "__all__", ())


def test_class_bases_name_only_public_classes(site: Site) -> None:
    """A class's bases are classes a reader can look up, not ``ContextDecorator``."""
    bad = set()
    for name in API_PAGES:
        page = site.text(site.root / "api" / name / "index.html")
        for part in page.split('<div class="doc doc-object doc-class">')[1:]:
            heading = re.search(r'<h\d id="(cudakit\.[\w.]+)"', part)
            bases = re.search(r'<p class="doc doc-class-bases">(.*?)</p>', part, re.S)
            if heading is None or bases is None or bases.start() > part.find("doc-children"):
                continue
            for path in re.findall(r'title="\s*(?:\w+ \()?([\w.]+)\)?"', bases.group(1)):
                if not _is_public(path):
                    bad.add(f"{heading.group(1)}: {path}")
    assert not bad, "; ".join(sorted(bad))


def test_inherited_members_are_described(site: Site) -> None:
    """A figure a class inherits from an internal base is on its page all the same."""
    ids = {obj for obj, _ in _api_objects(site)}
    for member in (
        "cudakit.memory.MemoryReport.peak_allocated",
        "cudakit.memory.MemoryMeter.peak_allocated",
        "cudakit.amp.AutocastStep.spike_steps",
    ):
        assert member in ids, f"{member} is not on the API pages"


def test_every_public_name_is_on_an_api_page(site: Site) -> None:
    import cudakit

    ids: set[str] = set()
    for name in API_PAGES:
        page = site.text(site.root / "api" / name / "index.html")
        ids.update(re.findall(r'<h\d id="(cudakit\.[\w.]+)"', page))
    missing = [
        n
        for n in cudakit.__all__
        if n != "__version__" and not any(i.endswith(f".{n}") for i in ids)
    ]
    assert not missing, f"not in the API reference: {missing}"


@pytest.mark.parametrize(
    "module_name",
    [
        "cudakit.amp",
        "cudakit.checkpoint",
        "cudakit.data",
        "cudakit.demo",
        "cudakit.device",
        "cudakit.exceptions",
        "cudakit.info",
        "cudakit.memory",
        "cudakit.parallel",
        "cudakit.speed",
        "cudakit.warmup",
    ],
)
def test_every_package_export_is_on_an_api_page(site: Site, module_name: str) -> None:
    ids = {obj for obj, _ in _api_objects(site)}
    module = importlib.import_module(module_name)
    missing = [n for n in module.__all__ if not any(i.endswith(f".{n}") for i in ids)]
    assert not missing, f"{module_name} exports names the API pages leave out: {missing}"


def _returns_first_cells(site: Site) -> list[tuple[str, str]]:
    """(object, first cell) of every row of every Returns table that has a Name column."""
    found = []
    for page in (site.root / "api").rglob("index.html"):
        text = site.text(page)
        heads = [(m.start(), m.group(1)) for m in re.finditer(r'<h\d id="([\w.]+)"', text)]
        for m in re.finditer(r"Returns:</span></p>\s*<table>(.*?)</table>", text, re.S):
            table = m.group(1)
            if "<th>Name</th>" not in table:
                continue
            owner = [name for pos, name in heads if pos < m.start()][-1]
            for row in re.findall(r'<tr class="doc-section-item">(.*?)</tr>', table, re.S):
                found.append((owner, _plain(re.findall(r"<td>(.*?)</td>", row, re.S)[0])))
    return found


def test_no_returns_table_names_an_article(site: Site) -> None:
    garbled = [
        (owner, cell) for owner, cell in _returns_first_cells(site) if cell in {"A", "An", "The"}
    ]
    assert not garbled, garbled


def test_no_paragraph_ends_in_a_literal_double_colon(site: Site) -> None:
    """reST's ``text::`` before a literal block renders as ``text:`` and a code block."""
    bad = []
    for page in site.pages():
        for para in re.findall(r"<p>((?:(?!<p>).)*?)</p>", site.text(page), re.S):
            if _plain(para).endswith("::"):
                bad.append(f"{page.relative_to(site.root)}: ...{_plain(para)[-60:]!r}")
    assert not bad, bad


# -- the site as a whole ------------------------------------------------------------


#: Addresses that would be the project's own home (its repository, its documentation host)
#: if it had one. It has none yet: the site must not point at places nobody here owns.
_HOMES = re.compile(
    r"""(?:https?:)?//(?:[\w.-]*cudakit[\w.-]*\.[a-z]{2,}"""  # cudakit.readthedocs.io, cudakit.dev
    r"""|(?:www\.)?(?:github|gitlab|bitbucket)\.(?:com|org)/cudakit\b)""",  # a forge's cudakit/
    re.I,
)


def test_mkdocs_names_no_home_the_project_does_not_own() -> None:
    import yaml

    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    loaded = yaml.safe_load(re.sub(r"!!python/\S+", "", config))
    assert not {"site_url", "repo_url", "repo_name", "edit_uri"} & set(loaded), (
        "mkdocs.yml names a repository or documentation host; add it back once the project owns one"
    )


def test_the_site_links_to_no_home_the_project_does_not_own(site: Site) -> None:
    files = [*site.pages(), *site.root.rglob("*.xml")]
    found = {
        f"{page.relative_to(site.root)}: {m.group(0)}"
        for page in files
        for m in _HOMES.finditer(page.read_text(encoding="utf-8"))
    }
    assert not found, sorted(found)


def test_the_home_pattern_finds_what_it_should() -> None:
    for bad in (
        'href="https://github.com/cudakit/cudakit"',
        "git clone https://github.com/cudakit/cudakit.git",
        "<loc>https://cudakit.readthedocs.io/api/</loc>",
        'href="//gitlab.com/cudakit/x"',
    ):
        assert _HOMES.search(bad), bad
    for fine in (
        'href="https://pytorch.org/docs/stable/amp.html"',
        'href="https://github.com/pytorch/pytorch/issues/1"',
        'href="../api/memory/#cudakit.memory.memory_report"',
        "https://github.com/Lightning-AI/pytorch-lightning/blob/master/src/cudakit_like.py",
    ):
        assert not _HOMES.search(fine), fine


def test_changelog_page_includes_the_changelog(site: Site) -> None:
    """docs/changelog.md includes CHANGELOG.md, so the site's page is the file itself."""
    page = _plain(site.text(site.root / "changelog" / "index.html"))
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "--8<--" not in page
    for heading in re.findall(r"^#{2,3} (.+)$", changelog, re.M):
        assert heading in page
    for entry in re.findall(r"^- (.+)$", changelog, re.M):
        first_words = _plain(re.sub(r"`|\*\*", "", entry))[:40]
        assert first_words in re.sub(r"\s+", " ", page), first_words


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_every_figure_referenced_exists(site: Site) -> None:
    images = 0
    for page in site.pages():
        for src in re.findall(r'<img[^>]* src="([^"]+)"', site.text(page)):
            if src.startswith(("http:", "https:", "data:")):
                continue
            images += 1
            target = (page.parent / src).resolve()
            assert target.is_file(), f"{page.relative_to(site.root)} shows a missing {src}"
    assert images >= 4
    referenced = set()
    for md in DOCS.rglob("*.md"):
        referenced.update(re.findall(r"\(figures/([\w.-]+\.png)\)", md.read_text(encoding="utf-8")))
    assert referenced == {p.name for p in FIGURES.glob("*.png")}, "a figure is missing or unused"


def test_ci_builds_the_site_strictly() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^[^#\n]*mkdocs build --strict", ci, re.M)


# -- the figures --------------------------------------------------------------------


def _make_figures() -> Any:
    spec = importlib.util.spec_from_file_location("make_figures", ROOT / "scripts/make_figures.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_figures_regenerates_every_figure(tmp_path: Path) -> None:
    """One command redraws every PNG in docs/figures/ from the data beside it."""
    pytest.importorskip("matplotlib", reason='the "plot" extra: pip install -e ".[plot]"')
    made = _make_figures().make_all(tmp_path)
    assert sorted(p.name for p in made) == sorted(p.name for p in FIGURES.glob("*.png"))
    for path in made:
        assert _png_size(path) == _png_size(FIGURES / path.name), (
            f"{path.name}: the committed figure differs in size from what the data draws; "
            "run python scripts/make_figures.py"
        )


def test_no_returns_section_starts_with_a_role() -> None:
    """Google-style Returns read "A :class:`X` ..." as "name: description"; keep roles out."""
    import ast

    bad = []
    for path in sorted((Path(__file__).resolve().parents[2] / "cudakit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            doc = (
                ast.get_docstring(node, clean=True)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                else None
            )
            lines = (doc or "").splitlines()
            for i, line in enumerate(lines[:-1]):
                if line.strip() == "Returns:" and ":" in lines[i + 1].split("``")[0]:
                    bad.append(f"{path.name}:{node.name}: {lines[i + 1].strip()}")  # type: ignore[attr-defined]
    assert not bad, bad
