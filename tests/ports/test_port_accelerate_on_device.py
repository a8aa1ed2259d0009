"""on_device against accelerate's send_to_device tests.

Ported from Hugging Face accelerate tests/test_utils.py (test_send_to_device,
test_named_tuples, test_send_to_device_compiles, and send_to_device's handling of
non-tensor leaves, objects with a ``.to`` method, parameters, modules and optimizers).
Tensors go to the meta device, which every machine has.
"""

from __future__ import annotations

from collections import UserDict, namedtuple
from typing import NamedTuple

import torch

from cudakit import on_device

ExampleNamedTuple = namedtuple("ExampleNamedTuple", "a b c")
DEV = "meta"


def test_send_to_device() -> None:
    tensor = torch.randn(5, 2)
    r1 = on_device(tensor, device=DEV)
    assert r1.device.type == DEV
    assert r1.shape == tensor.shape

    r2 = on_device((tensor, [tensor, tensor], 1), device=DEV)
    assert isinstance(r2, tuple)
    assert isinstance(r2[1], list)
    assert [r2[0].device.type, r2[1][0].device.type, r2[1][1].device.type] == [DEV] * 3
    assert r2[2] == 1

    r3 = on_device({"a": tensor, "b": [tensor, tensor], "c": 1}, device=DEV)
    assert isinstance(r3, dict)
    assert isinstance(r3["b"], list)
    assert [r3["a"].device.type, r3["b"][0].device.type] == [DEV] * 2
    assert r3["c"] == 1

    r4 = on_device(ExampleNamedTuple(a=tensor, b=[tensor, tensor], c=1), device=DEV)
    assert isinstance(r4, ExampleNamedTuple)
    assert isinstance(r4.b, list)
    assert [r4.a.device.type, r4.b[1].device.type] == [DEV] * 2
    assert r4.c == 1

    r5 = on_device(UserDict({"a": tensor, "b": [tensor, tensor], "c": 1}), device=DEV)
    assert isinstance(r5, UserDict)
    assert isinstance(r5["b"], list)
    assert [r5["a"].device.type, r5["b"][0].device.type] == [DEV] * 2
    assert r5["c"] == 1


def test_send_to_device_same_device_keeps_values() -> None:
    tensor = torch.randn(5, 2)
    out = on_device({"a": tensor, "b": (tensor,)}, device="cpu")
    assert torch.equal(out["a"], tensor)
    assert torch.equal(out["b"][0], tensor)


def test_named_tuples() -> None:
    class QuantTensorBase(NamedTuple):
        value: torch.Tensor
        scale: torch.Tensor | None
        zero_point: torch.Tensor | None

    class QuantTensorSubclass(QuantTensorBase):
        pass

    a = QuantTensorBase(torch.tensor(1.0), None, None)
    b = QuantTensorSubclass(torch.tensor(1.0), torch.tensor(2.0), None)
    ma, mb = on_device(a, b, device=DEV)
    assert type(ma) is QuantTensorBase
    assert type(mb) is QuantTensorSubclass
    assert ma.value.device.type == DEV
    assert mb.scale is not None
    assert mb.scale.device.type == DEV
    assert mb.zero_point is None

    point = namedtuple("point", ["x", "y"])(11, y=22)
    assert on_device(point, device=DEV) is point  # nothing to move: returned as is
    plain = on_device((torch.ones(1), 2), device=DEV)
    assert type(plain) is tuple
    assert plain[1] == 2


def test_send_to_device_compiles() -> None:
    compiled = torch.compile(lambda t: on_device(t, device="cpu"), fullgraph=True)
    assert compiled(torch.zeros([1], dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_non_tensor_leaves_are_kept() -> None:
    ids = ["a", "b"]
    out = on_device({"x": torch.ones(2), "ids": ids, "n": 3, "none": None, "s": "str"}, device=DEV)
    assert out["ids"] is ids
    assert (out["n"], out["none"], out["s"]) == (3, None, "str")


def test_object_with_to_method_is_copied_then_moved() -> None:
    """Objects with ``.to`` (BatchEncoding-like) move by it; yours stays (a shallow copy)."""

    class Batch:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def to(self, device: str, non_blocking: bool = False) -> Batch:
            self.t = self.t.to(device)
            return self

    b = Batch(torch.ones(2))
    out = on_device(b, device=DEV)
    assert out.t.device.type == DEV
    assert b.t.device.type == "cpu"


def test_parameter_moves_and_keeps_requires_grad() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    out = on_device({"p": p}, device=DEV)["p"]
    assert isinstance(out, torch.nn.Parameter)
    assert out.requires_grad
    assert out.grad is not None
    assert out.grad.device.type == DEV


def test_module_and_optimizer_state_moved_in_place() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    m, o = on_device(model, opt, device=DEV)
    assert m is model
    assert o is opt
    assert model.weight.device.type == DEV
    state = next(iter(opt.state.values()))
    assert state["exp_avg"].device.type == DEV
    assert state["step"].device.type == "cpu"  # a non-capturable step count stays on the CPU
