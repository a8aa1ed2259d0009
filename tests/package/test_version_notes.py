"""Version notes in docstrings agree with the package's version.

Nothing is released yet (``__version__`` is ``0.1.0.dev0``): every public name is new
in the first release, so each ``.. versionadded::`` says ``0.1`` and there is no
``.. versionchanged::`` until something changes after a release.
"""

from __future__ import annotations

import re
from pathlib import Path

import cudakit

PACKAGE = Path(cudakit.__file__).resolve().parent
NOTE = re.compile(r"\.\. version(added|changed):: *(\S+)")


def _release(version: str) -> tuple[int, ...]:
    """``"0.1.0.dev0"`` -> ``(0, 1)``: the release a development version leads to."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    assert m is not None, f"not a version: {version!r}"
    parts = [int(p) for p in m.group(0).split(".")]
    while len(parts) > 2 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_release_of_a_version() -> None:
    assert _release("0.1.0.dev0") == (0, 1)
    assert _release("0.2.0") == (0, 2)
    assert _release("1.0.3") == (1, 0, 3)


def test_no_note_names_a_version_after_the_next_release() -> None:
    current = _release(cudakit.__version__)
    released = "dev" not in cudakit.__version__
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = NOTE.search(line)
            if m is None:
                continue
            kind, version = m.groups()
            where = f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
            if _release(version) > current:
                bad.append(f"{where} (the package is {cudakit.__version__})")
            elif kind == "changed" and not released and _release(version) >= current:
                bad.append(f"{where} (changed before its first release)")
    assert not bad, "\n".join(bad)
