"""The walker at its edges: registering built-in container subclasses, immutable dict
subclasses, the copy mode towards MPS, and no left-behind warning for objects that only
reach tensors the same call moves (an LR scheduler, an EMA helper holding the model)."""

from __future__ import annotations

import collections
import warnings
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from cudakit import register_container
from cudakit._tree import Ctx
from cudakit.device import on_device
from cudakit.exceptions import TensorsLeftBehindWarning

META = torch.device("meta")


@pytest.fixture(autouse=True)
def fresh_warnings() -> None:
    from cudakit._tree import forget_warnings

    forget_warnings()


# ---------------------------------------------------- registering built-in subclasses


class _Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class _Batch(dict):  # type: ignore[type-arg]
    pass


class _Items(list):  # type: ignore[type-arg]
    pass


class _Window(collections.deque):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize("cls", [_Batch, _Items, _Pair, _Window, collections.OrderedDict])
def test_registering_a_builtin_container_subclass_is_refused_without_flatten(cls: type) -> None:
    with pytest.raises(
        ValueError,
        match=rf"register_container\(cls=\.\.\.\) expects a class whose items cudakit does "
        rf"not walk already.*{cls.__name__} is a .* subclass: on_device already walks its items",
    ):
        register_container(cls)


def test_builtin_subclasses_still_move_after_a_refused_registration() -> None:
    with pytest.raises(ValueError, match="already walks its items"):
        register_container(_Batch)
    out = on_device(_Batch(x=torch.ones(1)), device="meta")
    assert type(out) is _Batch
    assert out["x"].device == META


def test_a_builtin_subclass_registers_with_its_own_flatten_and_unflatten() -> None:
    class Tagged(dict):  # type: ignore[type-arg]
        pass

    register_container(
        Tagged, flatten=lambda d: dict(d), unflatten=lambda d, moved: Tagged(moved, tag="moved")
    )
    out = on_device(Tagged(x=torch.ones(1)), device="meta")
    assert out["x"].device == META
    assert out["tag"] == "moved"


@pytest.mark.parametrize("cls", [object, type(None)])
def test_registering_object_or_none_is_refused(cls: type) -> None:
    with pytest.raises(
        ValueError, match=r"register_container\(cls=\.\.\.\) expects a class of your own"
    ):
        register_container(cls)


# ------------------------------------------------------------ immutable dict subclass


class _FrozenDict(dict):  # type: ignore[type-arg]
    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError(f"{type(self).__name__} is immutable")


def test_an_immutable_dict_subclass_is_rebuilt_from_a_dict() -> None:
    t = torch.ones(2)
    fd = _FrozenDict(x=t, label="cat", again=t)
    out = on_device(fd, device="meta")
    assert type(out) is _FrozenDict
    assert out["x"].device == META
    assert out["again"] is out["x"]  # aliasing kept
    assert out["label"] == "cat"
    assert fd["x"] is t  # the caller's object is untouched


# --------------------------------------------------------------------- MPS copy mode


def test_copies_to_mps_are_synchronous_by_default() -> None:
    # CPU -> MPS non_blocking copies from pageable memory can be read before they land
    # (pytorch/pytorch#83015); Lightning Fabric blocks there too.
    assert Ctx(torch.device("mps"), None).nb is False
    assert Ctx(torch.device("mps"), True).nb is True  # forced: honoured
    assert Ctx(torch.device("meta"), None).nb is False
    assert Ctx(torch.device("cpu"), None).nb is False


# ------------------------------------------------ no false left-behind warnings


class _EMA:
    """Keeps a reference to the model being trained (a common helper)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.decay = 0.99


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("order", ["model-first", "scheduler-first"])
def test_no_warning_for_objects_that_only_reach_what_the_call_moves(order: str) -> None:
    model, opt = _trained()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    ema = _EMA(model)
    args = (model, opt, sched, ema) if order == "model-first" else (sched, ema, model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TensorsLeftBehindWarning)
        out = on_device(*args, device="meta")
    assert out[args.index(sched)] is sched
    assert model.weight.device == META
    state = next(iter(opt.state.values()))
    assert state["momentum_buffer"].device == META


def test_a_helper_holding_a_model_the_call_does_not_move_still_warns() -> None:
    model, _ = _trained()
    shadow = nn.Linear(2, 2)
    ema = _EMA(shadow)  # its own copy of the weights, not moved by this call
    with pytest.warns(TensorsLeftBehindWarning, match=r"_EMA"):
        on_device(model, ema, device="meta")
    assert shadow.weight.device.type == "cpu"


def test_a_tensor_the_call_copies_is_still_left_behind_in_an_unknown_object() -> None:
    class Holder:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    t = torch.ones(1)
    with pytest.warns(TensorsLeftBehindWarning, match=r"Holder"):
        moved, holder = on_device(t, Holder(t), device="meta")
    assert moved.device == META
    assert holder.t is t


def test_a_dict_subclass_that_refuses_replacing_a_key_is_a_clear_error() -> None:
    class WriteOnce(dict):  # type: ignore[type-arg]
        def __setitem__(self, key: Any, value: Any) -> None:
            if key in self:
                raise KeyError(f"{key} already set")
            super().__setitem__(key, value)

    with pytest.raises(TypeError, match=r"cannot rebuild .*WriteOnce"):
        on_device(WriteOnce(x=torch.ones(1)), device="meta")


def test_an_immutable_dict_subclass_keeps_its_attributes() -> None:
    fd = _FrozenDict(x=torch.ones(1))
    fd.tag = "val"  # type: ignore[attr-defined]
    out = on_device(fd, device="meta")
    assert out.tag == "val"


def test_registering_object_says_why() -> None:
    with pytest.raises(ValueError, match=r"every class.*Register only your own classes"):
        register_container(object)


def test_an_object_whose_attributes_raise_does_not_break_the_move() -> None:
    class Weird:
        __slots__ = ("a",)

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("boom")

    w = Weird()
    w.a = torch.ones(1)
    moved, same = on_device(torch.ones(1), w, device="meta")
    assert moved.device == META
    assert same is w
