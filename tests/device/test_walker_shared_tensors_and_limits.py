"""Defects found in review of the walker, each reproduced as a test."""

from __future__ import annotations

import collections
import sys
import types
import warnings

import pytest
import torch

import cudakit
from cudakit import on_device, register_container
from cudakit.exceptions import TensorsLeftBehindWarning


def test_registered_flatten_that_builds_new_objects_keeps_each_instance() -> None:
    class Pair:
        def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
            self.a, self.b = a, b

    register_container(
        Pair,
        flatten=lambda p: {"ab": [p.a, p.b]},
        unflatten=lambda p, moved: Pair(*moved["ab"]),
    )
    pairs = [Pair(torch.ones(i + 1), torch.ones(i + 1)) for i in range(4)]
    out = on_device(pairs, device="meta")
    assert [tuple(p.a.shape) for p in out] == [(1,), (2,), (3,), (4,)]
    assert len({id(p) for p in out}) == 4


def test_a_parameter_and_its_grad_stay_shared() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    for batch in ({"p": p, "g": p.grad}, {"g": p.grad, "p": p}):
        out = on_device(batch, device="meta")
        assert out["p"].grad is out["g"]


def test_deque_subclasses_keep_attributes_and_init() -> None:
    class Tagged(collections.deque):  # type: ignore[type-arg]
        pass

    class Named(collections.deque):  # type: ignore[type-arg]
        def __init__(self, name: str, items: tuple[torch.Tensor, ...] = ()) -> None:
            super().__init__(items)
            self.name = name

    d = Tagged([torch.ones(1)], maxlen=4)
    d.tag = "x"  # type: ignore[attr-defined]
    out = on_device(d, device="meta")
    assert type(out) is Tagged
    assert out.tag == "x"
    assert out.maxlen == 4
    assert out[0].is_meta
    named = on_device(Named("n", (torch.ones(1),)), device="meta")
    assert named.name == "n"
    assert named[0].is_meta


def test_tuple_subclasses_keep_attributes() -> None:
    class TS(tuple):  # type: ignore[type-arg]
        pass

    ts = TS((torch.ones(1),))
    ts.tag = 1  # type: ignore[attr-defined]
    out = on_device(ts, device="meta")
    assert type(out) is TS
    assert out.tag == 1
    assert out[0].is_meta


def test_parameter_subclasses_and_attributes_survive() -> None:
    class Sharded(torch.nn.Parameter):
        pass

    p = Sharded(torch.ones(2))
    p.tp_rank = 3  # type: ignore[attr-defined]
    out = on_device({"w": p}, device="meta")["w"]
    assert type(out) is Sharded
    assert out.tp_rank == 3
    assert out.is_meta


@pytest.mark.parametrize("spec", ["cpu:0", "meta:0"])
def test_indexed_cpu_and_meta_specs_mean_the_plain_device(spec: str) -> None:
    assert cudakit.resolve_device(spec) == torch.device(spec.split(":")[0])
    t = torch.ones(1, device=spec.split(":")[0])
    batch = {"t": [t], "n": 1}
    assert on_device(batch, device=spec) is batch


def test_tensors_deep_or_far_inside_unknown_objects_warn_at_the_caller() -> None:
    from cudakit._tree import forget_warnings

    forget_warnings()

    class Holder:
        def __init__(self) -> None:
            self.items = [None] * 20 + [torch.ones(1)]

    for obj in (types.SimpleNamespace(cfg={"a": {"b": [torch.ones(1)]}}), Holder()):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            on_device(obj, device="meta")
        hits = [w for w in caught if issubclass(w.category, TensorsLeftBehindWarning)]
        assert len(hits) == 1
        assert hits[0].filename == __file__
    forget_warnings()


def test_nesting_past_the_recursion_limit_is_a_clear_error() -> None:
    deep: list[object] = [torch.ones(1)]
    for _ in range(sys.getrecursionlimit()):
        deep = [deep]
    with pytest.raises(ValueError, match="nested deeper than Python's recursion limit"):
        on_device(deep, device="meta")
