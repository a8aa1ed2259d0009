"""The supported Python and torch range is said once and tested: pyproject, CI, the docs.

The default pair (README's commands, the whole suite in ``.ci/run``) and the pairs of
``.ci/matrix`` (a fast subset each) together are the tested matrix. pyproject's bounds
and classifiers, README and docs/compatibility.md must name the same range, and each end
of it must be one of the tested pairs.
"""

from __future__ import annotations

import re
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

import cudakit

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MATRIX = (ROOT / ".ci" / "matrix").read_text()
README = (ROOT / "README.md").read_text()
COMPAT = (ROOT / "docs" / "compatibility.md").read_text()

Version = tuple[int, ...]


def _v(text: str) -> Version:
    return tuple(int(p) for p in text.split("."))


def _default_pair() -> tuple[Version, Version]:
    """Python of CI's ``python3`` (pinned in .ci/run) and README's torch pin."""
    py = re.search(r"^DEFAULT_PYTHON=(\d+\.\d+)$", (ROOT / ".ci" / "run").read_text(), re.M)
    torch = re.search(r"pip install torch==(\d+\.\d+\.\d+) ", README)
    assert py, "the default Python: DEFAULT_PYTHON= in .ci/run"
    assert torch, "the default torch: pip install torch==X in README"
    return _v(py.group(1)), _v(torch.group(1))


def _matrix_pairs() -> list[tuple[Version, Version]]:
    pairs = re.findall(r'^\s*"(\d+\.\d+) (\d+\.\d+\.\d+)"', MATRIX, re.M)
    assert pairs, ".ci/matrix lists its pairs as lines of PAIRS=( ... )"
    return [(_v(py), _v(torch)) for py, torch in pairs]


def _tested() -> list[tuple[Version, Version]]:
    return [_default_pair(), *_matrix_pairs()]


def _floor(spec: str) -> Version:
    m = re.fullmatch(r">=(\d+(?:\.\d+)*)", spec)
    assert m, f"expected a lone lower bound, got {spec!r}"
    return _v(m.group(1))


def _torch_spec() -> str:
    (spec,) = (d[len("torch") :] for d in PYPROJECT["project"]["dependencies"] if d[:5] == "torch")
    return spec


def test_requires_python_is_the_oldest_tested_python() -> None:
    floor = _floor(PYPROJECT["project"]["requires-python"])
    assert min(py for py, _ in _tested()) == floor
    assert sys.version_info[:2] >= floor


def test_classifiers_name_exactly_the_tested_pythons() -> None:
    prefix = "Programming Language :: Python :: 3."
    named = {
        _v(c.removeprefix("Programming Language :: Python :: "))
        for c in PYPROJECT["project"]["classifiers"]
        if c.startswith(prefix)
    }
    assert named == {py for py, _ in _tested()}


def test_torch_floor_is_a_tested_pair_and_nothing_older_is_claimed() -> None:
    floor = _floor(_torch_spec())
    torches = [torch[: len(floor)] for _, torch in _tested()]
    assert min(torches) == floor, f"pyproject says torch>={floor}; the matrix tests {torches}"


def test_oldest_and_newest_python_each_meet_both_ends_of_torch() -> None:
    """The matrix pairs the newest Python with the newest torch, and tests the floor."""
    tested = _tested()
    newest_py = max(py for py, _ in tested)
    newest_torch = max(torch for _, torch in tested)
    assert (newest_py, newest_torch) in tested


def test_readme_and_every_page_state_the_same_torch_floor() -> None:
    assert f"`torch{_torch_spec()}`" in README
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        if page.name == "changelog.md":
            continue  # history names the old bounds
        for said in re.findall(r"`torch>=[\d.]+`", page.read_text()):
            assert said == f"`torch{_torch_spec()}`", f"{page.name} says {said}"


def test_compatibility_page_states_the_range_and_lists_every_tested_pair() -> None:
    py_floor = ".".join(map(str, _floor(PYPROJECT["project"]["requires-python"])))
    torch_floor = ".".join(map(str, _floor(_torch_spec())))
    assert f"| Python | {py_floor} and newer |" in COMPAT
    assert f"| PyTorch | {torch_floor} and newer |" in COMPAT
    for py, torch in _tested():
        row = f"| {'.'.join(map(str, py))} | {'.'.join(map(str, torch))} |"
        assert row in COMPAT, f"docs/compatibility.md lacks the tested pair {row}"


def test_ci_runs_the_matrix_and_its_subset_exists() -> None:
    assert ".ci/matrix" in (ROOT / ".ci" / "run").read_text()
    subset = re.search(r"SUBSET=\((.*?)\)", MATRIX, re.S)
    assert subset
    for path in subset.group(1).split():
        assert (ROOT / path).exists(), f".ci/matrix runs {path}, which is gone"


# The warning filter: torch's own warnings about the interpreter or the profiler are
# ignored by message; every warning cudakit raises stays an error in the tests.

FILTERS: list[str] = PYPROJECT["tool"]["pytest"]["ini_options"]["filterwarnings"]


def test_warnings_are_errors_and_each_exception_names_a_message() -> None:
    assert FILTERS[0] == "error"
    for line in FILTERS[1:]:
        action, message, category, *_ = [*line.split(":"), "", ""]
        assert action == "ignore", line
        assert message, line
        assert not message.startswith(("cudakit", ".*")), line
        assert category.endswith("Warning"), line


def _cudakit_warnings() -> list[type[Warning]]:
    found = {
        obj
        for mod in (cudakit, cudakit.amp, cudakit.exceptions)
        for obj in vars(mod).values()
        if isinstance(obj, type) and issubclass(obj, Warning)
    }
    assert found, "cudakit exports its warning classes"
    return sorted(found, key=lambda c: c.__name__)


@pytest.mark.parametrize(
    "category", [*_cudakit_warnings(), UserWarning, RuntimeWarning, DeprecationWarning]
)
def test_a_cudakit_warning_is_an_error(category: type[Warning]) -> None:
    for message in ("cudakit: skipping checkpoint x", "cudakit.old is deprecated", "anything"):
        with pytest.raises(category):
            warnings.warn(message, category, stacklevel=1)


@pytest.mark.parametrize(
    ("message", "category"),
    [
        ("Guards may run slower on Python 3.13.0. Consider upgrading.", RuntimeWarning),
        ("`torch.jit.script_method` is deprecated. Please switch.", DeprecationWarning),
    ],
)
def test_torch_warnings_about_the_interpreter_or_itself_are_let_through(
    message: str, category: type[Warning]
) -> None:
    warnings.warn(message, category, stacklevel=1)  # ignored, not raised
