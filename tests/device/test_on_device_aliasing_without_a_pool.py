"""Aliasing through the inline paths of plain dicts, lists and tuples, with no outside
reference to the tensors.

The walker looks a plain tensor up in its memo only when the input may hold it more
than once (its reference count says so), or once another path (a Parameter's
``.grad``, a module's parameters) has put tensors in the memo. These tests build inputs
whose tensors are held by nothing but the input itself, a mix of tensors held once
and tensors held several times, with Parameters and their gradients, and check that
every input tensor maps to exactly one output tensor and back. The other property
tests draw tensors from a pool that the test keeps, so every tensor there is held
more than once.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cudakit.device import on_device

META = torch.device("meta")

# A leaf spec: ("fresh",) a tensor only this slot holds, ("shared", i) pool tensor i,
# ("param", i) pool Parameter i (with a .grad), ("grad", i) that Parameter's .grad,
# ("leaf", v) a plain value.
_leaf_specs = st.one_of(
    st.just(("fresh",)),
    st.tuples(st.just("shared"), st.integers(0, 2)),
    st.tuples(st.just("param"), st.integers(0, 1)),
    st.tuples(st.just("grad"), st.integers(0, 1)),
    st.tuples(st.just("leaf"), st.one_of(st.none(), st.integers(), st.text(max_size=2))),
)
_specs = st.recursive(
    _leaf_specs,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4).map(lambda xs: ("list", xs)),
        st.lists(kids, max_size=4).map(lambda xs: ("tuple", xs)),
        st.dictionaries(st.text(max_size=2), kids, max_size=4).map(lambda d: ("dict", d)),
    ),
    max_leaves=14,
)


def _build(spec: Any) -> Any:
    """The input a spec describes; no reference to its tensors survives outside it."""
    shared = [torch.randn(2) for _ in range(3)]
    params = []
    for _ in range(2):
        p = torch.nn.Parameter(torch.randn(2))
        p.grad = torch.randn(2)
        params.append(p)

    def make(s: Any) -> Any:
        kind = s[0]
        if kind == "fresh":
            return torch.randn(2)
        if kind == "shared":
            return shared[s[1]]
        if kind == "param":
            return params[s[1]]
        if kind == "grad":
            return params[s[1]].grad
        if kind == "leaf":
            return s[1]
        if kind == "list":
            return [make(c) for c in s[1]]
        if kind == "tuple":
            return tuple(make(c) for c in s[1])
        return {k: make(c) for k, c in s[1].items()}

    return make(spec)  # shared and params go out of scope here


def _pairs(orig: Any, moved: Any, out: list[tuple[Any, Any]]) -> None:
    if isinstance(orig, torch.Tensor):
        out.append((orig, moved))
        if isinstance(orig, torch.nn.Parameter) and orig.grad is not None:
            out.append((orig.grad, moved.grad))
    elif isinstance(orig, dict):
        assert type(moved) is dict
        assert list(orig) == list(moved)
        for k in orig:
            _pairs(orig[k], moved[k], out)
    elif isinstance(orig, (list, tuple)):
        assert type(moved) is type(orig)
        assert len(orig) == len(moved)
        for a, b in zip(orig, moved, strict=True):
            _pairs(a, b, out)
    else:
        assert moved is orig


@given(_specs)
def test_every_input_tensor_maps_to_one_output_tensor_and_back(spec: Any) -> None:
    obj = _build(spec)
    moved = on_device(obj, device="meta")
    pairs: list[tuple[Any, Any]] = []
    _pairs(obj, moved, pairs)
    forward: dict[int, int] = {}
    for a, b in pairs:
        assert b.device == META
        assert type(b) is type(a)  # a Parameter stays one
        assert forward.setdefault(id(a), id(b)) == id(b)  # moved once, shared
    assert len(set(forward.values())) == len(forward)  # distinct stay distinct
    assert on_device(moved, device="meta") is moved


def test_a_grad_met_after_its_parameter_in_a_nested_list_is_shared() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.zeros(2)
    for batch in ([p, [p.grad]], [[p.grad], p], {"p": p, "g": [(p.grad,)]}):
        out = on_device(batch, device="meta")
        flat: list[tuple[Any, Any]] = []
        _pairs(batch, out, flat)
        moved_grads = {id(b) for a, b in flat if a is p.grad}
        assert len(moved_grads) == 1


def test_tensors_held_once_are_copied_once_each() -> None:
    batch = [[torch.ones(1) for _ in range(3)] for _ in range(3)]
    out = on_device(batch, device="meta")
    moved = [t for row in out for t in row]
    assert len({id(t) for t in moved}) == 9
    assert all(t.device == META for t in moved)


def test_a_tensor_another_path_moved_is_looked_up_even_when_held_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Parameter's .grad is memoised by the Parameter's path; the inline paths must
    then look every tensor up, whatever its reference count says (here: held once)."""
    import cudakit._tree.walk as tree

    fake_sys = types.SimpleNamespace(
        getrefcount=lambda obj: 0, getrecursionlimit=sys.getrecursionlimit
    )
    monkeypatch.setattr(tree, "sys", fake_sys)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.zeros(2)
    for batch in ([p, [p.grad]], {"p": p, "g": p.grad}, (p, {"g": (p.grad,)})):
        flat: list[tuple[Any, Any]] = []
        _pairs(batch, on_device(batch, device="meta"), flat)
        assert len({id(b) for a, b in flat if a is p.grad}) == 1
