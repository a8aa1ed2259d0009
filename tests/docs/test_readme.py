"""README.md starts with the two commands, and CI runs the test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_readme_starts_with_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    head = text.split("\n\n", 3)
    assert head[0] == "# cudakit"
    assert head[1].startswith("```bash\n")
    assert head[2].startswith("```bash\n")
    demo, tests = _commands()[:2]
    assert demo.endswith("cudakit demo")
    assert tests.endswith("python -m pytest")
    for cmd in (demo, tests):
        # the newest tested torch, pinned (docs/compatibility.md)
        assert "pip install torch==2.15.0 && pip install -e" in cmd


def test_ci_runs_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert _commands()[1] in ci.splitlines()
    checks = ("ruff check .", "ruff format --check .", "mypy --strict cudakit/", "mkdocs build")
    for check in checks:
        assert check in ci
    assert "set -euo pipefail" in ci


def test_readme_python_example_runs(tmp_path: Path, monkeypatch: object) -> None:
    import os

    blocks = re.findall(r"```python\n(.+?)\n```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "README.md should show a short example"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for block in blocks:
            exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
    finally:
        os.chdir(cwd)
