"""The one walker under on_device and prefetch: the container kinds it used to get wrong
(issue 14, items 1 to 6), container registration, and the left-behind warning."""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
import warnings
from collections import UserDict, deque
from typing import Any

import pytest
import torch
from hypothesis import given
from strategies import Movable, nested

from cudakit.device import on_device
from cudakit.exceptions import TensorsLeftBehindWarning

META = torch.device("meta")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_warnings() -> None:
    """TensorsLeftBehindWarning is shown once per type and process: start afresh."""
    from cudakit._tree import forget_warnings

    forget_warnings()


# -- 1. deque ------------------------------------------------------------------------


def test_deque_items_are_moved_and_maxlen_kept() -> None:
    t = torch.ones(2)
    d = deque([t, "label", [t]], maxlen=5)
    out = on_device(d, device="meta")
    assert type(out) is deque
    assert out.maxlen == 5
    assert out[0].device == META
    assert out[1] == "label"
    assert out[2][0] is out[0]  # aliasing kept
    assert d[0] is t  # the caller's deque is untouched


def test_deque_subclass_keeps_its_type() -> None:
    class Window(deque):  # type: ignore[type-arg]
        pass

    out = on_device(Window([torch.ones(1)], maxlen=3), device="meta")
    assert type(out) is Window
    assert out.maxlen == 3
    assert out[0].device == META


# -- 2. dataclass with a cached_property -----------------------------------------------


@dataclasses.dataclass
class Cached:
    x: torch.Tensor

    @functools.cached_property
    def doubled(self) -> torch.Tensor:
        return self.x * 2


def test_cached_property_is_not_left_stale() -> None:
    obj = Cached(torch.ones(2))
    assert obj.doubled.device == CPU  # computed and cached on the CPU
    out = on_device(obj, device="meta")
    assert out.x.device == META
    assert out.doubled.device == META  # recomputed from the moved field
    assert obj.doubled.device == CPU  # the caller's object keeps its own cache


# -- 3. optimizer per-parameter state that is not a dict ---------------------------------


@dataclasses.dataclass
class MomentumState:
    buf: torch.Tensor
    step: int = 0


class DataclassStateSGD(torch.optim.Optimizer):
    """A custom optimizer that keeps its per-parameter state in a dataclass."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = MomentumState(torch.zeros_like(p))

    def step(self, closure: Any = None) -> None:
        return None


def test_optimizer_state_that_is_not_a_dict_follows() -> None:
    model = torch.nn.Linear(2, 2)
    opt = DataclassStateSGD(model.parameters())
    out_opt = on_device(opt, device="meta")
    assert out_opt is opt
    assert len(opt.state) == 2
    for state in opt.state.values():
        assert isinstance(state, MomentumState)
        assert state.buf.device == META


# -- 4. a .to() that works in place and returns None -------------------------------------


class InPlaceNone:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device: Any, non_blocking: bool = False) -> None:
        self.x = self.x.to(device)


def test_to_returning_none_gives_the_moved_object() -> None:
    obj = InPlaceNone(torch.ones(2))
    out = on_device({"o": obj}, device="meta")
    assert isinstance(out["o"], InPlaceNone)
    assert out["o"].x.device == META
    assert obj.x.device == CPU  # moved on a copy: the caller's object is untouched


# -- 5. objects with their own .to(): aliasing, in-place movers ---------------------------


class BatchEncodingLike(UserDict):  # type: ignore[type-arg]
    """transformers' BatchEncoding: a UserDict whose .to() moves in place and returns self."""

    def __init__(self, data: dict[str, Any]) -> None:
        super().__init__(data)
        self.encodings = ["tokens"]

    def to(self, device: Any, non_blocking: bool = False) -> BatchEncodingLike:
        self.data = {k: v.to(device) for k, v in self.data.items()}
        return self


class _Store:
    def __init__(self) -> None:
        self.mapping: dict[str, Any] = {}

    def __copy__(self) -> _Store:
        new = _Store()
        new.mapping = dict(self.mapping)
        return new


class DataLike:
    """PyG's Data: tensors in a store, .to() moves them in place and returns self."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.store = _Store()
        self.store.mapping.update(tensors)

    def __copy__(self) -> DataLike:
        new = DataLike.__new__(DataLike)
        new.store = __import__("copy").copy(self.store)
        return new

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["store"].mapping[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device: Any, non_blocking: bool = False) -> DataLike:
        for k, v in self.store.mapping.items():
            self.store.mapping[k] = v.to(device)
        return self


def test_batch_encoding_like_keeps_aliasing_and_the_callers_batch() -> None:
    ids = torch.ones(2, 3)
    enc = BatchEncodingLike({"input_ids": ids, "mask": ids})
    batch = {"enc": enc, "ids": ids}
    out = on_device(batch, device="meta")
    assert type(out["enc"]) is BatchEncodingLike
    assert out["enc"].encodings == ["tokens"]
    assert out["enc"]["input_ids"] is out["enc"]["mask"] is out["ids"]  # copied once
    assert out["ids"].device == META
    assert enc["input_ids"] is ids  # the caller's batch is unchanged
    assert enc is not out["enc"]


def test_in_place_to_does_not_change_the_callers_object() -> None:
    x = torch.ones(3)
    data = DataLike(x=x)
    out = on_device([data], device="meta")
    assert out[0].x.device == META
    assert data.x is x  # moved on a shallow copy


def test_registered_object_with_to_keeps_aliasing() -> None:
    from cudakit import register_container

    class Graph:
        def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
            self.x, self.y = x, y

        def to(self, device: Any) -> Graph:
            return Graph(self.x.to(device), self.y.to(device))

    register_container(Graph)
    t = torch.ones(2)
    out = on_device({"g": Graph(t, t), "t": t}, device="meta")
    assert out["g"].x is out["g"].y is out["t"]


# -- 6. plain objects holding tensors ----------------------------------------------------


class Holder:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


def test_plain_object_holding_tensors_warns_once_per_type() -> None:
    class LocalHolder:
        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

    obj = LocalHolder(torch.ones(1))
    with pytest.warns(TensorsLeftBehindWarning) as record:
        out = on_device({"h": obj}, device="meta")
    assert out["h"] is obj  # left alone, unchanged
    assert obj.x.device == CPU
    message = str(record[0].message)
    assert "LocalHolder" in message
    assert "cudakit.register_container(LocalHolder)" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on_device({"h": obj}, device="meta")  # once per type: no second warning


def test_simple_namespace_holding_tensors_warns() -> None:
    ns = types.SimpleNamespace(x=torch.ones(1), name="a")
    with pytest.warns(TensorsLeftBehindWarning, match="SimpleNamespace"):
        out = on_device([ns], device="meta")
    assert out[0] is ns


def test_plain_object_without_tensors_is_a_quiet_leaf() -> None:
    class Config:
        def __init__(self) -> None:
            self.lr = 0.1

    cfg = Config()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert on_device({"cfg": cfg, "t": torch.ones(1)}, device="meta")["cfg"] is cfg


def test_registered_plain_object_is_moved() -> None:
    from cudakit import register_container

    class Sample:
        def __init__(self, x: torch.Tensor, label: str) -> None:
            self.x = x
            self.label = label

    register_container(Sample)
    s = Sample(torch.ones(2), "cat")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = on_device(s, device="meta")
    assert type(out) is Sample
    assert out.x.device == META
    assert out.label == "cat"
    assert s.x.device == CPU


def test_registered_with_flatten_and_unflatten() -> None:
    from cudakit import register_container

    class Frame:
        __slots__ = ("pixels", "ts")

        def __init__(self, pixels: torch.Tensor, ts: float) -> None:
            self.pixels = pixels
            self.ts = ts

    register_container(
        Frame,
        flatten=lambda f: {"pixels": f.pixels},
        unflatten=lambda f, moved: Frame(moved["pixels"], f.ts),
    )
    out = on_device(collections.OrderedDict(f=Frame(torch.ones(1), 2.5)), device="meta")
    assert out["f"].pixels.device == META
    assert out["f"].ts == 2.5


def test_error_inside_a_registered_container_names_the_path() -> None:
    from cudakit import register_container

    class Box:
        def __init__(self, items: Any) -> None:
            self.items = items

    register_container(Box)
    with pytest.raises(TypeError, match=r"found at obj\['b'\]\.items\[1\]"):
        on_device({"b": Box([torch.ones(1), (i for i in range(2))])}, device="meta")


# -- register_container's own arguments --------------------------------------------------


def test_register_container_refuses_an_instance() -> None:
    from cudakit import register_container

    with pytest.raises(
        TypeError,
        match=r"register_container\(cls=\.\.\.\) expects a class, got Holder <.*Pass the class "
        r"itself, e.g\. register_container\(MyBatch\), not an instance\.",
    ):
        register_container(Holder(torch.ones(1)))  # type: ignore[type-var]


@pytest.mark.parametrize("arg", ["flatten", "unflatten"])
def test_register_container_refuses_a_non_callable(arg: str) -> None:
    from cudakit import register_container

    class Mine:
        pass

    with pytest.raises(
        TypeError,
        match=rf"register_container\({arg}=\.\.\.\) expects a function or None, got int 3\. "
        rf"Pass {arg}=lambda obj: \.\.\. or leave it out",
    ):
        register_container(Mine, **{arg: 3})
    assert on_device(Mine(), device="meta").__class__ is Mine  # nothing was registered


@pytest.mark.parametrize("cls", [dict, list, torch.Tensor, torch.nn.Linear, torch.optim.SGD])
def test_register_container_refuses_types_cudakit_handles(cls: type) -> None:
    from cudakit import register_container

    with pytest.raises(
        ValueError,
        match=rf"register_container\(cls=\.\.\.\) expects a class of your own, got \w+ <class .*"
        rf"cudakit already moves {cls.__name__} objects",
    ):
        register_container(cls)


def test_register_container_is_a_class_decorator() -> None:
    from cudakit import register_container

    @register_container
    class Decorated:
        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

    assert on_device(Decorated(torch.ones(1)), device="meta").x.device == META


def test_a_failing_flatten_names_the_object_and_the_path() -> None:
    from cudakit import register_container

    class Broken:
        pass

    def flatten(obj: Broken) -> dict[str, Any]:
        raise KeyError("nope")

    register_container(Broken, flatten=flatten)
    batch = {"b": Broken()}
    with pytest.raises(
        TypeError,
        match=r"cannot take apart the Broken at obj\['b'\]: the flatten registered for it "
        r"raised KeyError: 'nope'\. flatten\(obj\) must return a dict",
    ):
        on_device(batch, device="meta")


# -- one strategy for on_device and prefetch: the same structure for the same batch ------


def same_structure(a: Any, b: Any) -> None:
    """Same container types and plain leaves; tensors by device, dtype and shape."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.device, a.dtype, a.shape) == (b.device, b.dtype, b.shape)
    elif isinstance(a, Movable):
        same_structure(a.value, b.value)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        if isinstance(a, collections.defaultdict):
            assert a.default_factory is b.default_factory
        for k in a:
            same_structure(a[k], b[k])
    elif isinstance(a, (list, tuple, deque)):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            same_structure(u, v)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            same_structure(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, (set, frozenset)):
        assert len(a) == len(b)
    else:
        assert a is b


@given(nested(max_leaves=8, movable=True))
def test_on_device_and_prefetch_give_the_same_structure(batch: Any) -> None:
    from cudakit._tree import Staging, move_root
    from cudakit.data import prefetch

    expected = on_device(batch, device="meta")
    # prefetch on a non-CUDA device: the plain moving iterator.
    (moving,) = list(prefetch([batch], device="meta"))
    same_structure(moving, expected)
    # prefetch on CUDA: the staged walk (pin, copy, list), aimed at "meta" here.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "pin_memory", lambda self, device=None: self.clone())
        mp.setattr(torch.Tensor, "is_pinned", lambda self, device=None: False)
        staging = Staging(pin=True)
        staged = move_root(batch, META, True, "batch", staging)
    same_structure(staged, expected)
    assert all(t.device == META for t in staging.created)


@given(nested(max_leaves=8))
def test_moving_never_changes_the_callers_batch(batch: Any) -> None:
    before = repr(batch)
    on_device(batch, device="meta")
    assert repr(batch) == before


def test_tensors_nested_inside_a_plain_object_are_noticed() -> None:
    class Parts:
        def __init__(self) -> None:
            self.parts = {"a": [torch.ones(1)]}
            self.name = "p"

    with pytest.warns(TensorsLeftBehindWarning, match=r"register_container\(Parts\)"):
        on_device(Parts(), device="meta")


# -- aliasing when the input holds the only references ------------------------------------


def test_aliasing_kept_for_tensors_held_only_by_the_input() -> None:
    # The inline paths skip the memo for a tensor held once; one held twice must still
    # be copied once, even when nothing outside the input refers to it.
    lst = [torch.ones(1)] * 2
    out = on_device(lst, device="meta")
    assert out[0] is out[1]
    d = dict.fromkeys("ab", torch.ones(1))
    out_d = on_device(d, device="meta")
    assert out_d["a"] is out_d["b"]
    nested_pair = [[torch.ones(1)]]
    nested_pair.append(list(nested_pair[0]))
    out_n = on_device(nested_pair, device="meta")
    assert out_n[0][0] is out_n[1][0]
    mixed = {"x": torch.ones(1)}
    both = [mixed, (mixed["x"],)]
    del mixed
    out_m = on_device(both, device="meta")
    assert out_m[0]["x"] is out_m[1][0]
