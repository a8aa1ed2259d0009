"""One set of argument validators (``cudakit/_check.py``), used everywhere, one wording.

Every refused argument reads ``<func>(<arg>=...) expects <what>, got <type> <repr>.
<fix>``: ``TypeError`` for a wrong kind, ``ValueError`` for a wrong value. The scans
below keep hand-written checks of ints, numbers, bools and callables out of the
package, and every argument's refusal in words of its own (the one wording written
out by hand, or ``takes``/``must be``); the properties pin the validators themselves.
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cudakit._check import (
    check_bool,
    check_callable,
    check_extra,
    check_int,
    check_number,
    describe,
)

PACKAGE = Path(__file__).resolve().parents[2] / "cudakit"

#: A refusal in the one wording, with the fix after the value.
WORDING = re.compile(r"^(?P<func>[\w.@]+)\((?P<arg>[^)]*)=\.\.\.\) expects (?P<what>.+?), got ")

#: Names a kind test may use and still be a check of a number or a bool.
_NUMERIC = {"int", "float", "bool", "Integral", "Real", "numbers"}


def _name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _numeric(node: ast.AST) -> bool:
    names = {
        n.id if isinstance(n, ast.Name) else n.attr
        for n in ast.walk(node)
        if isinstance(n, (ast.Name, ast.Attribute))
    }
    return bool(names) and names <= _NUMERIC


def _kind_test(test: ast.expr, *, anywhere: bool = True) -> str | None:
    """The test of a number, bool or callable in an ``if``'s condition, if any.

    ``anywhere=False`` looks at the whole condition only, not at its parts (so
    ``label is not None and not callable(label)`` is not a single-kind test).
    """
    if not anywhere and isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        # ``key in opts and not is_int(opts[key])``: guards, then one kind test
        kinds = [v for v in test.values if _kind_test(v) or _tests_kind(v)]
        guards = all(_is_guard(v) for v in test.values if v not in kinds)
        return _kind_test(kinds[0], anywhere=False) if len(kinds) == 1 and guards else None
    for node in ast.walk(test) if anywhere else [test]:
        if (
            isinstance(node, ast.UnaryOp)
            and isinstance(node.op, ast.Not)
            and isinstance(node.operand, ast.Call)
        ):
            call = node.operand
            name = _name(call)
            if name in ("is_int", "is_real"):
                return f"not {name}(...)"
            if name == "isinstance" and len(call.args) == 2 and _numeric(call.args[1]):
                return "not isinstance(..., <number>)"
            if name == "callable" and isinstance(call.args[0], (ast.Name, ast.Attribute)):
                return "not callable(...)"
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            calls = [
                v.operand if isinstance(v, ast.UnaryOp) else v
                for v in node.values
                if isinstance(v.operand if isinstance(v, ast.UnaryOp) else v, ast.Call)
            ]
            if any(
                _name(v) == "isinstance" and len(v.args) == 2 and ast.unparse(v.args[1]) == "bool"
                for v in calls
            ) and (anywhere or all(_numeric(v.args[1]) for v in calls if len(v.args) == 2)):
                return "isinstance(..., bool) or ..."
    return None


def _is_guard(node: ast.expr) -> bool:
    """``x is not None`` or ``key in mapping``: the guard before an optional check."""
    return (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and (
            isinstance(node.ops[0], ast.In)
            or (isinstance(node.ops[0], ast.IsNot) and ast.unparse(node.comparators[0]) == "None")
        )
    )


def _tests_kind(node: ast.AST) -> bool:
    """Whether ``node`` tests a kind of any sort (``isinstance``, ``callable``, ...)."""
    return any(
        isinstance(n, ast.Call) and _name(n) in ("isinstance", "callable", "is_int", "is_real")
        for n in ast.walk(node)
    )


def _refusal(body: list[ast.stmt]) -> str | None:
    """How a branch refuses: ``"own"`` words (``raise TypeError(...)``/``ValueError``, or
    a module's own ``_fail`` helper), ``"shared"`` (``fail_type``/``fail_value``), or not."""
    shared = False
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in ("TypeError", "ValueError"):
                    return "own"
            if isinstance(node, ast.Call) and "fail" in _name(node):
                if _name(node) not in ("fail_type", "fail_value"):
                    return "own"
                shared = True
    return "shared" if shared else None


def hand_written_checks(root: Path) -> list[tuple[str, int, str]]:
    """``(module, line, test)`` for each hand-written check outside ``_check.py``.

    That is an ``if`` that tests a number, a bool or a callable and refuses in its own
    words, or tests just one such kind (a job for ``check_int``, ``check_number``,
    ``check_bool``, ``check_callable``) and calls ``fail_type``/``fail_value``.
    """
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "_check.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            refusal = _refusal(node.body) if isinstance(node, ast.If) else None
            if isinstance(node, ast.If) and refusal is not None:
                kind = _kind_test(node.test, anywhere=refusal == "own")
                if kind is not None:
                    found.append((path.relative_to(root).as_posix(), node.lineno, kind))
    return found


def test_no_hand_written_checks_of_ints_numbers_bools_or_callables() -> None:
    found = [f"{m}:{line}: {kind}" for m, line, kind in hand_written_checks(PACKAGE)]
    assert not found, "use the validators in cudakit/_check.py instead:\n" + "\n".join(found)


def test_the_scan_finds_each_hand_written_form(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "def f(n, x, b, fn):\n"
        "    if not is_int(n):\n"
        "        raise TypeError('n')\n"
        "    if isinstance(x, bool) or not isinstance(x, (int, float)):\n"
        "        fail_type('f', 'x', 'a number', x)\n"
        "    if not isinstance(b, bool):\n"
        "        raise ValueError('b')\n"
        "    if not callable(fn):\n"
        "        raise TypeError('fn')\n"
        "    if not is_int(n):\n"
        "        return None  # a predicate that refuses nothing is fine\n"
        "    if fn is not None and not callable(fn):\n"
        "        fail_type('f', 'fn', 'a function', fn)  # a guard, then one kind\n"
        "    if fn is not None and not callable(fn):\n"
        "        _fail('fn')  # a module's own words\n"
        "    if 'dim' in fn and not is_int(fn['dim']):\n"
        "        fail_type('f', 'dim', 'an int', fn)  # a guard, then one kind\n"
        "    if fn is not None and not isinstance(fn, str) and not callable(fn):\n"
        "        fail_type('f', 'fn', 'a str or a function', fn)  # two kinds: fine\n"
        "    if fn != 'auto' and not isinstance(fn, bool):\n"
        "        fail_type('f', 'fn', \"'auto', True or False\", fn)  # a choice or a bool\n"
    )
    assert [line for _, line, _ in hand_written_checks(tmp_path)] == [2, 4, 6, 8, 12, 14, 16]


#: An argument's refusal in words of its own: the one wording by hand (``f(arg=...)
#: expects ..., got``, or ``f() expects`` naming no argument), or the older ``f(arg=...)
#: takes``, ``f(arg) takes``, ``f(): arg must be``, ``f() arg must be``, ``f(arg=...)
#: must be``.
_DRIFT = (
    re.compile(r"^[\w.@{}]+\((?:[^)]*=\.\.\.)?\) expects .+?, got "),
    re.compile(r"[\w}]\(\w+(?:=\.\.\.)?\) takes "),
    re.compile(r"[\w}]\((?:\w+=[^)]*)?\):? (?:[a-z_]+ ){0,3}must be "),
)


def _constants(tree: ast.Module) -> dict[str, str]:
    """The module's own ``NAME = "text"`` constants (``_WHERE``), to read messages whole."""
    found = {}
    for stmt in tree.body:
        target = (
            stmt.targets[0]
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            else stmt.target
            if isinstance(stmt, ast.AnnAssign)
            else None
        )
        value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            found[target.id] = str(value.value)
    return found


def _text(node: ast.AST, constants: dict[str, str]) -> str:
    """A message's words, ``{}`` for each value put in (a known constant's text for one)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v, constants) for v in node.values)
    if isinstance(node, ast.FormattedValue) and isinstance(node.value, ast.Name):
        return constants.get(node.value.id, "{}")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left, constants) + _text(node.right, constants)
    return "{}"


def own_wording(root: Path) -> list[tuple[str, int, str]]:
    """``(module, line, words)`` for each ``raise TypeError/ValueError`` outside ``_check.py``
    that refuses an argument in its own words.

    That is the one wording written out by hand (``f(arg=...) expects ..., got``, a job
    for ``fail_type``/``fail_value`` or a ``check_*``), or the older ``takes``/``must
    be`` wordings. A check of data deep in a walk (``the field 'x' must be``, ``the
    loss must be``) names no argument this way and is left alone.
    """
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "_check.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = _constants(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            exc = node.exc.func
            if not (
                isinstance(exc, ast.Name)
                and exc.id in ("TypeError", "ValueError")
                and node.exc.args
            ):
                continue
            words = _text(node.exc.args[0], constants)
            if any(rule.search(words) for rule in _DRIFT):
                found.append((path.relative_to(root).as_posix(), node.lineno, words[:80]))
    return found


def test_no_argument_is_refused_in_its_own_words() -> None:
    found = [f"{m}:{line}: {words}" for m, line, words in own_wording(PACKAGE)]
    assert not found, "refuse through cudakit/_check.py's validators:\n" + "\n".join(found)


def test_the_wording_scan_finds_each_drift(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "WHERE = 'g(data)'\n"
        "def f(label, split, n, data, loss, fields):\n"
        "    raise TypeError(f'f(label=...) takes a string, got {label!r}.')\n"
        "    raise TypeError(f'f(label) takes a string, got {label!r}.')\n"
        "    raise TypeError(f'{WHERE} takes a dict, got {data!r}.')\n"
        "    raise ValueError(f'f() split must be a name, got {split!r}.')\n"
        "    raise TypeError(f'{func}(): split must be one of a, b, got {split!r}.')\n"
        "    raise ValueError(f'f(n={n}) must be >= 0.')\n"
        "    raise TypeError(f'f(extra=...) keys must be str names, got {n!r}.')\n"
        "    raise TypeError(f'{func}(): wrapper option names must be strings.')\n"
        "    raise TypeError('f(n=...) expects an int, ' f'got {describe(n)}.')\n"
        "    raise ValueError(f'{func}() expects a model, got {n}.')\n"
        "    raise ValueError(f'{WHERE}: the field {fields!r} must be finite.')  # data\n"
        "    raise TypeError('f: the loss must be a tensor, got ' + repr(loss))  # data\n"
        "    raise TypeError(f'f(strategy=\"none\") takes no options, got {n}.')  # a pairing\n"
        "    raise TypeError(f'launch() must send fn to new processes: {n}')  # no argument\n"
        "    raise ValueError(f'f(n={n}) is not a precision f knows; pass a dtype.')\n"
    )
    assert [line for _, line, _ in own_wording(tmp_path)] == list(range(3, 13))


# --------------------------------------------------------------------- the wording


def _parts(exc: BaseException) -> dict[str, str]:
    match = WORDING.match(str(exc))
    assert match, f"not in the one wording: {exc}"
    return match.groupdict()


ints = st.integers(min_value=-(10**6), max_value=10**6)
not_ints = st.one_of(
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.none(),
    st.lists(st.integers(), max_size=2),
)


@given(value=ints, minimum=st.none() | ints, maximum=st.none() | ints)
def test_check_int_takes_exactly_the_ints_in_range(
    value: int, minimum: int | None, maximum: int | None
) -> None:
    inside = (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if inside:
        assert check_int("f", "n", value, minimum=minimum, maximum=maximum) == value
        assert check_int("f", "n", np.int64(value), minimum=minimum, maximum=maximum) == value
        return
    with pytest.raises(ValueError, match=WORDING.pattern) as info:
        check_int("f", "n", value, minimum=minimum, maximum=maximum)
    parts = _parts(info.value)
    assert (parts["func"], parts["arg"]) == ("f", "n")
    assert parts["what"].startswith("an int")
    assert f"got int {value!r}. Pass e.g. n=" in str(info.value)


@given(value=not_ints)
def test_check_int_refuses_other_kinds_with_a_type_error(value: object) -> None:
    with pytest.raises(TypeError) as info:
        check_int("f", "n", value, minimum=1)
    assert _parts(info.value) == {"func": "f", "arg": "n", "what": "an int >= 1"}
    assert str(info.value).endswith(f"got {describe(value)}. Pass e.g. n=1.")


@given(
    value=st.floats(allow_nan=True, allow_infinity=True) | ints,
    positive=st.booleans(),
    minimum=st.none() | st.floats(-10, 10),
    below=st.none() | st.floats(-10, 10),
)
def test_check_number_takes_exactly_the_finite_numbers_in_range(
    value: float, positive: bool, minimum: float | None, below: float | None
) -> None:
    inside = (
        math.isfinite(value)
        and (not positive or value > 0)
        and (minimum is None or value >= minimum)
        and (below is None or value < below)
    )
    kwargs = {"positive": positive, "minimum": minimum, "below": below}
    if inside:
        assert check_number("f", "x", value, **kwargs) == float(value)  # type: ignore[arg-type]
        return
    with pytest.raises(ValueError, match=WORDING.pattern) as info:
        check_number("f", "x", value, **kwargs)  # type: ignore[arg-type]
    assert _parts(info.value)["what"].startswith(("a finite number", "a positive finite"))


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({}, "a finite number"),
        ({"positive": True}, "a positive finite number"),
        ({"minimum": 0}, "a finite number >= 0"),
        ({"minimum": 0, "below": 1}, "a finite number in [0, 1)"),
        ({"positive": True, "maximum": 1}, "a finite number in (0, 1]"),
        ({"maximum": 5}, "a finite number <= 5"),
        ({"below": 2, "finite": False}, "a number < 2"),
    ],
)
def test_check_number_says_the_range_and_gives_an_example_inside_it(
    kwargs: dict[str, float], what: str
) -> None:
    with pytest.raises(TypeError) as info:
        check_number("f", "x", "1", **kwargs)  # type: ignore[arg-type]
    assert _parts(info.value)["what"] == what
    example = float(str(info.value).rsplit("x=", 1)[1].rstrip("."))
    assert check_number("f", "x", example, **kwargs) == example  # type: ignore[arg-type]


@given(value=st.one_of(st.integers(), st.text(max_size=3), st.none(), st.floats()))
def test_check_bool_takes_only_true_and_false(value: object) -> None:
    with pytest.raises(TypeError) as info:
        check_bool("f", "flag", value)
    assert _parts(info.value) == {"func": "f", "arg": "flag", "what": "True or False"}
    assert str(info.value).endswith("Pass flag=True or flag=False.")
    assert check_bool("f", "flag", True) is True


def test_check_callable_names_what_it_expected() -> None:
    assert check_callable("f", "fn", len, expected="a function") is len
    with pytest.raises(TypeError, match=r"^f\(fn=\.\.\.\) expects a function, got int 3\. Do"):
        check_callable("f", "fn", 3, expected="a function", fix="Do.")


def test_check_extra_keeps_stateful_objects_tensors_and_generators() -> None:
    model = torch.nn.Linear(1, 1)
    items = (model, torch.ones(1), torch.Generator())
    assert check_extra("f", list(items)) == items


@pytest.mark.parametrize(
    ("extra", "what", "fix"),
    [
        (3, "a tuple of objects with state_dict()", "For one object write extra=(obj,)."),
        ("ab", "a tuple of objects with state_dict()", "For one object write extra=(obj,)."),
        ((torch.nn.Linear,), "objects, not classes", "Pass the Linear you train with"),
        ((object(),), "objects with state_dict()", "Leave it out"),
    ],
)
def test_check_extra_refuses_in_the_one_wording(extra: object, what: str, fix: str) -> None:
    with pytest.raises(TypeError) as info:
        check_extra("f", extra)
    parts = _parts(info.value)
    assert (parts["func"], parts["arg"]) == ("f", "extra")
    assert parts["what"].startswith(what)
    assert fix in str(info.value)
