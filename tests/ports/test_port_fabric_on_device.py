"""on_device against Lightning's apply_to_collection and move_data_to_device tests.

Ported from lightning_utilities tests/core/test_apply_func.py
(test_recursive_application_to_collection and its dataclass, namedtuple and mapping
edge cases), Lightning Fabric tests_fabric/utilities/test_apply_func.py
(test_wrongly_implemented_transferable_data_type, move_data_to_device's non_blocking
and dtype handling) and tests_fabric/test_fabric.py (setup_module with parameters
still on the meta device). Tensors go to the meta device, which every machine has.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import types
import warnings
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from collections.abc import Iterator
from dataclasses import InitVar
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from torch import nn

import cudakit
from cudakit import on_device

DEV = "meta"
ONE = torch.tensor(1)  # a dataclass default below (a call there trips ruff's RUF009)


@pytest.mark.parametrize("should_return", [False, True])
def test_wrongly_implemented_transferable_data_type(should_return: bool) -> None:
    class TensorObject:
        def __init__(self, tensor: torch.Tensor, should_return: bool = True) -> None:
            self.tensor = tensor
            self.should_return = should_return

        def to(self, device: str) -> TensorObject | None:
            self.tensor.to(device)
            return self if self.should_return else None

    obj = TensorObject(torch.tensor(0.1), should_return)
    out = on_device(obj, device="cpu")
    # Fabric returns obj itself; cudakit a shallow copy (documented), never None.
    assert isinstance(out, TensorObject)
    assert torch.equal(out.tensor, obj.tensor)


def test_recursive_application_to_collection() -> None:
    ntc = namedtuple("Foo", ["bar"])

    @dataclasses.dataclass
    class Feature:
        input_ids: torch.Tensor
        segment_ids: torch.Tensor

    @dataclasses.dataclass
    class ModelExample:
        example_ids: list[str]
        feature: Feature
        label: torch.Tensor
        some_constant: int = dataclasses.field(init=False)

        def __post_init__(self) -> None:
            self.some_constant = 7

    @dataclasses.dataclass
    class WithClassVar:
        class_var: ClassVar[int] = 0
        dummy: Any

    @dataclasses.dataclass
    class WithInitVar:
        dummy: Any
        override: InitVar[Any | None] = None

        def __post_init__(self, override: Any | None) -> None:
            if override is not None:
                self.dummy = override

    @dataclasses.dataclass
    class WithClassAndInitVar:
        class_var: ClassVar[torch.Tensor] = torch.tensor(0)
        dummy: Any
        override: InitVar[Any | None] = ONE

        def __post_init__(self, override: Any | None) -> None:
            if override is not None:
                self.dummy = override

    model_example = ModelExample(
        example_ids=["i-1", "i-2", "i-3"],
        feature=Feature(
            input_ids=torch.tensor([1.0, 2.0, 3.0]), segment_ids=torch.tensor([4.0, 5.0, 6.0])
        ),
        label=torch.tensor([7.0, 8.0, 9.0]),
    )
    to_reduce = {
        "a": torch.tensor([1.0]),
        "b": [torch.tensor([2.0])],
        "c": (torch.tensor([100.0]),),
        "d": ntc(bar=5.0),
        "e": 5,
        "f": "this_is_a_dummy_str",
        "g": 12.0,
        "h": Feature(
            input_ids=torch.tensor([1.0, 2.0, 3.0]), segment_ids=torch.tensor([4.0, 5.0, 6.0])
        ),
        "i": model_example,
        "j": WithClassVar(torch.arange(3)),
        "k": WithInitVar("this_gets_overridden", torch.tensor([2.0])),
        "l": WithClassAndInitVar(model_example, None),
        "m": OrderedDict(x=torch.ones(2)),
        "n": defaultdict(list, y=torch.ones(2)),
    }
    out = on_device(to_reduce, device=DEV)
    assert isinstance(out, dict)
    assert out["a"].device.type == DEV
    assert isinstance(out["b"], list)
    assert out["b"][0].device.type == DEV
    assert isinstance(out["c"], tuple)
    assert out["c"][0].device.type == DEV
    assert isinstance(out["d"], ntc)
    assert out["d"].bar == 5.0
    assert (out["e"], out["f"], out["g"]) == (5, "this_is_a_dummy_str", 12.0)
    assert isinstance(out["h"], Feature)
    assert out["h"].input_ids.device.type == out["h"].segment_ids.device.type == DEV
    example = out["i"]
    assert isinstance(example, ModelExample)
    assert example.example_ids == ["i-1", "i-2", "i-3"]
    assert example.feature.input_ids.device.type == example.label.device.type == DEV
    assert example.some_constant == 7
    assert isinstance(out["j"], WithClassVar)
    assert out["j"].dummy.device.type == DEV
    assert WithClassVar.class_var == 0
    assert isinstance(out["k"], WithInitVar)
    assert out["k"].dummy.device.type == DEV
    assert isinstance(out["l"], WithClassAndInitVar)
    assert out["l"].dummy.label.device.type == DEV
    assert WithClassAndInitVar.class_var.device.type == "cpu"  # class variables stay
    assert type(out["m"]) is OrderedDict
    assert out["m"]["x"].device.type == DEV
    assert type(out["n"]) is defaultdict
    assert out["n"].default_factory is list
    assert out["n"]["y"].device.type == DEV
    # The input is untouched.
    assert to_reduce["a"].device.type == "cpu"
    assert model_example.label.device.type == "cpu"


def test_frozen_and_slotted_dataclass() -> None:
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        x: torch.Tensor
        y: int = 3

    @dataclasses.dataclass(slots=True)
    class Slotted:
        x: torch.Tensor
        z: torch.Tensor = dataclasses.field(init=False)

        def __post_init__(self) -> None:
            self.z = self.x * 2

    f = on_device(Frozen(torch.ones(2)), device=DEV)
    assert isinstance(f, Frozen)
    assert f.x.device.type == DEV
    assert f.y == 3
    s = on_device(Slotted(torch.ones(2)), device=DEV)
    assert isinstance(s, Slotted)
    assert s.x.device.type == s.z.device.type == DEV


def test_dataclass_init_false_field_set_later() -> None:
    @dataclasses.dataclass
    class D:
        a: torch.Tensor
        b: torch.Tensor = dataclasses.field(init=False)

    d = D(torch.ones(1))
    d.b = torch.zeros(1)
    out = on_device(d, device=DEV)
    assert out.a.device.type == out.b.device.type == DEV


def test_dataclass_init_false_field_never_set() -> None:
    @dataclasses.dataclass
    class D:
        a: torch.Tensor
        b: int = dataclasses.field(init=False)

    out = on_device(D(torch.ones(1)), device=DEV)
    assert out.a.device.type == DEV
    assert not hasattr(out, "b")


@pytest.mark.parametrize("non_blocking", [None, True, False])
def test_non_blocking_on_cpu(non_blocking: bool | None) -> None:
    x = {"a": torch.ones(3), "b": [torch.zeros(2)]}
    assert on_device(x, device="cpu", non_blocking=non_blocking) is x  # nothing to move


def test_non_blocking_passed_to_custom_to() -> None:
    calls = []

    class Batch:
        def __init__(self) -> None:
            self.t = torch.ones(1)

        def to(self, device: str, non_blocking: bool = False) -> Batch:
            calls.append(non_blocking)
            self.t = self.t.to(device, non_blocking=non_blocking)
            return self

    on_device(Batch(), device=DEV, non_blocking=True)
    on_device(Batch(), device=DEV, non_blocking=False)
    assert calls == [True, False]

    class BatchWithoutNonBlocking:
        def __init__(self) -> None:
            self.t = torch.ones(1)

        def to(self, device: str) -> BatchWithoutNonBlocking:
            self.t = self.t.to(device)
            return self

    out = on_device(BatchWithoutNonBlocking(), device=DEV, non_blocking=True)
    assert out.t.device.type == DEV


def test_dtypes_kept() -> None:
    dtypes = [torch.int64, torch.float16, torch.bfloat16, torch.bool, torch.complex64]
    out = on_device([torch.ones(2, dtype=d) for d in dtypes], device=DEV)
    assert [t.dtype for t in out] == dtypes
    assert all(t.device.type == DEV for t in out)


def test_list_subclass_keeps_type_and_attributes() -> None:
    class MyList(list[torch.Tensor]):
        tag = ""

    items = MyList([torch.ones(1)])
    items.tag = "x"
    out = on_device(items, device=DEV)
    assert type(out) is MyList
    assert out.tag == "x"
    assert out[0].device.type == DEV


def test_userdict_subclass_batchencoding_like() -> None:
    class Encoding(UserDict[str, torch.Tensor]):
        def __init__(self, data: dict[str, torch.Tensor], extra: str) -> None:
            super().__init__(data)
            self.extra = extra

    be = Encoding({"ids": torch.ones(2)}, extra="e")
    out = on_device(be, device=DEV)
    assert isinstance(out, Encoding)
    assert out["ids"].device.type == DEV
    assert out.extra == "e"
    assert be["ids"].device.type == "cpu"


def test_non_string_keys_and_none() -> None:
    out = on_device({1: None, (1, 2): torch.ones(1)}, device=DEV)
    assert out[1] is None
    assert out[1, 2].device.type == DEV


def test_torch_size_device_dtype_numpy_enum_left_alone() -> None:
    batch = {
        "s": torch.Size([2, 3]),
        "d": torch.device("cpu"),
        "t": torch.float16,
        "x": torch.ones(1),
        "np": np.ones(2),
        "e": enum.Enum("E", "A").A,
    }
    out = on_device(batch, device=DEV)
    for k in ("s", "d", "t", "np", "e"):
        assert out[k] is batch[k], k
    assert out["x"].device.type == DEV


def test_deque_set_frozenset() -> None:
    t = torch.ones(1)
    d = on_device(collections.deque([t, torch.zeros(1)], maxlen=5), device=DEV)
    assert isinstance(d, collections.deque)
    assert d.maxlen == 5
    assert d[0].device.type == DEV
    s = on_device({t}, device=DEV)
    assert isinstance(s, set)
    assert next(iter(s)).device.type == DEV
    assert isinstance(on_device(frozenset([t]), device=DEV), frozenset)


def test_mappingproxy() -> None:
    out = on_device(types.MappingProxyType({"a": torch.ones(1)}), device=DEV)
    assert out["a"].device.type == DEV


def test_module_with_parameters_on_meta_refused() -> None:
    m = nn.Linear(2, 2)
    m.bias = nn.Parameter(torch.empty(2, device="meta"))
    with pytest.raises(ValueError, match="is on the meta device and holds no data"):
        on_device(m, device="cpu")
    assert m.weight.device.type == "cpu"


def test_refused_call_changes_nothing() -> None:
    m = nn.Linear(2, 2)

    def gen() -> Iterator[int]:
        yield 1

    with pytest.raises(TypeError, match="cannot move a generator"):
        on_device(m, {"g": gen()}, device=DEV)
    assert m.weight.device.type == "cpu"


def test_decorator_on_method_staticmethod_classmethod() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        @on_device("meta")
        def f(self, x: torch.Tensor, *, y: torch.Tensor) -> tuple[torch.device, torch.device]:
            return x.device, y.device

        @staticmethod
        @on_device("meta")
        def g(x: torch.Tensor) -> torch.device:
            return x.device

        @on_device("meta")
        @classmethod
        def h(cls, x: torch.Tensor) -> torch.device:
            return x.device

    net = Net()
    meta = torch.device("meta")
    assert net.f(torch.ones(1), y=torch.ones(1)) == (meta, meta)
    assert Net.g(torch.ones(1)) == meta
    assert Net.h(torch.ones(1)) == meta
    assert net.lin.weight.device.type == "cpu"  # self is not moved


def test_aliasing_kept() -> None:
    w = nn.Linear(2, 2).weight
    out = on_device({"w": w, "again": w, "list": [w]}, device=DEV)
    assert out["w"] is out["again"] is out["list"][0]


def test_register_container_class_decorator() -> None:
    @cudakit.register_container
    class Holder:
        def __init__(self, a: torch.Tensor) -> None:
            self.a = a

    h = Holder(torch.ones(1))
    out = on_device(h, device=DEV)
    assert isinstance(out, Holder)
    assert out.a.device.type == DEV
    assert h.a.device.type == "cpu"


def test_unknown_object_with_tensors_warns_once_per_type() -> None:
    class Unknown:  # a type of its own: the warning comes once per type and process
        def __init__(self) -> None:
            self.x = torch.ones(1)

    with pytest.warns(cudakit.TensorsLeftBehindWarning):
        out = on_device(Unknown(), device=DEV)
    assert out.x.device.type == "cpu"  # left behind
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on_device(Unknown(), device=DEV)


def test_tensor_subclass_kept() -> None:
    class MyTensor(torch.Tensor):
        pass

    out = on_device({"t": torch.ones(2).as_subclass(MyTensor)}, device=DEV)
    assert isinstance(out["t"], MyTensor)


def test_sparse_tensor() -> None:
    out = on_device(torch.eye(3).to_sparse(), device=DEV)
    assert out.is_sparse
    assert out.device.type == DEV


def test_requires_grad_kept() -> None:
    x = torch.ones(2, requires_grad=True)
    assert on_device(x * 2, device=DEV).requires_grad
