"""on_device: every supported type, aliasing, identity, non_blocking policy, errors, forms."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import types
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Frozen, Pair, Record, nested, nested_with_pool

import cudakit._tree as tree
import cudakit.device._handlers as handlers
from cudakit.device import OnDeviceDecorator, on_device, resolve_device
from cudakit.exceptions import DeviceError

META = torch.device("meta")
PLAIN = (int, float, str, bytes, type(None), torch.dtype, torch.device)
# Hypothesis reports the (tensor-heavy) examples it draws; that cost is not ours to test.
big_repr_ok = pytest.mark.filterwarnings("ignore:Generating overly large repr")


# ----------------------------------------------------------------------------- helpers


def walk_pairs(orig: Any, moved: Any, out: list[tuple[Any, Any]]) -> None:
    """Walk two structures in parallel, checking types match; collect leaf pairs."""
    assert type(orig) is type(moved), (type(orig), type(moved))
    if isinstance(orig, torch.Tensor):
        out.append((orig, moved))
    elif isinstance(orig, Mapping):
        assert list(orig.keys()) == list(moved.keys())
        for k in orig:
            walk_pairs(orig[k], moved[k], out)
    elif isinstance(orig, (list, tuple, deque)):
        assert len(orig) == len(moved)
        for a, b in zip(orig, moved, strict=True):
            walk_pairs(a, b, out)
    elif isinstance(orig, frozenset | set):
        assert len(orig) == len(moved)
        # set order is by hash (identity for tensors): compare the plain leaves only
        assert {x for x in orig if isinstance(x, PLAIN)} == {
            x for x in moved if isinstance(x, PLAIN)
        }
    elif dataclasses.is_dataclass(orig):
        for f in dataclasses.fields(orig):
            walk_pairs(getattr(orig, f.name), getattr(moved, f.name), out)
    else:
        out.append((orig, moved))


def check_moved(orig: Any, moved: Any, device: torch.device, *, values: bool) -> None:
    pairs: list[tuple[Any, Any]] = []
    walk_pairs(orig, moved, pairs)
    mapping: dict[int, int] = {}
    for a, b in pairs:
        if isinstance(a, torch.Tensor):
            assert b.device.type == device.type
            assert b.dtype == a.dtype
            assert b.shape == a.shape
            if values:
                assert torch.equal(b.cpu(), a.cpu())
            # aliasing: the same input tensor maps to one output tensor, and vice versa
            assert mapping.setdefault(id(a), id(b)) == id(b)
        else:
            assert b is a  # non-tensor leaves are the same objects
    assert len(set(mapping.values())) == len(mapping)


# ------------------------------------------------------------------- property tests


@big_repr_ok
@given(nested_with_pool())
def test_property_move_to_meta(data: tuple[Any, list[torch.Tensor]]) -> None:
    obj, _pool = data
    moved = on_device(obj, device="meta")
    check_moved(obj, moved, META, values=False)
    # idempotent: moving again changes nothing and returns the very same object
    assert on_device(moved, device="meta") is moved


def _tensors_in(x: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure, sets included."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, Mapping):
        x = list(x.values())
    elif dataclasses.is_dataclass(x):
        x = [getattr(x, f.name) for f in dataclasses.fields(x)]
    elif not isinstance(x, (list, tuple, set, frozenset, deque)):
        return []
    return [t for v in x for t in _tensors_in(v)]


@big_repr_ok
@given(nested_with_pool(also_on="meta"))
def test_property_mixed_moved_and_in_place(data: tuple[Any, list[torch.Tensor]]) -> None:
    # Tensors already on the target and tensors that must move, side by side in every
    # container: exercises the adaptive skip of Tensor.to in the dict/list fast paths.
    obj, _pool = data
    moved = on_device(obj, device="meta")
    check_moved(obj, moved, META, values=False)
    pairs: list[tuple[Any, Any]] = []
    walk_pairs(obj, moved, pairs)  # (sets are compared by their plain leaves only)
    for a, b in pairs:
        if isinstance(a, torch.Tensor):
            assert (b is a) is a.is_meta  # in place: the very object; else a copy
    # a structure whose tensors were all in place comes back as itself, and only then
    before = _tensors_in(obj)
    assert (moved is obj) is all(t.is_meta for t in before)
    assert {id(t) for t in _tensors_in(moved)} >= {id(t) for t in before if t.is_meta}
    assert on_device(moved, device="meta") is moved


@big_repr_ok
@given(nested())
def test_property_nothing_to_move_returns_same_object(obj: Any) -> None:
    assert on_device(obj, device="cpu") is obj


@big_repr_ok
@given(nested(st.one_of(st.integers(), st.text(max_size=3), st.none())))
def test_property_no_tensors_no_copies(obj: Any) -> None:
    assert on_device(obj, device="meta") is obj


@pytest.mark.cuda
@big_repr_ok
@given(nested_with_pool())
def test_property_cuda_round_trip(data: tuple[Any, list[torch.Tensor]]) -> None:
    obj, _pool = data
    cuda = resolve_device("cuda")
    moved = on_device(obj, device=cuda)
    check_moved(obj, moved, cuda, values=True)
    assert on_device(moved, device=cuda) is moved
    back = on_device(moved, device="cpu", non_blocking=True)
    check_moved(obj, back, torch.device("cpu"), values=True)


# ------------------------------------------------------------------------ tensors


def test_tensor_moves_and_keeps_dtype() -> None:
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    m = on_device(t, device="meta")
    assert m.device == META
    assert m.dtype == torch.int16
    assert m.shape == (2, 3)


def test_tensor_already_there_is_returned_as_is() -> None:
    t = torch.ones(2, device=resolve_device())
    assert on_device(t, device=t.device) is t
    assert on_device(t) is t  # the default device is resolve_device()


@pytest.mark.parametrize("requires_grad", [True, False])
def test_parameter_stays_parameter(requires_grad: bool) -> None:
    p = torch.nn.Parameter(torch.ones(3), requires_grad=requires_grad)
    if requires_grad:
        p.grad = torch.full((3,), 2.0)
    m = on_device(p, device="meta")
    assert type(m) is torch.nn.Parameter
    assert m.requires_grad is requires_grad
    assert m.is_leaf
    assert m.device == META
    if requires_grad:
        assert m.grad is not None
        assert m.grad.device == META
    assert p.device.type == "cpu"  # the input is untouched


class TaggedTensor(torch.Tensor):
    """A tensor subclass: .to() keeps the subclass through __torch_function__."""


def test_tensor_subclass_keeps_its_type() -> None:
    t = torch.ones(2).as_subclass(TaggedTensor)
    m = on_device({"t": t}, device="meta")["t"]
    assert type(m) is TaggedTensor
    assert m.device == META


# ------------------------------------------------------------------------ modules


def test_module_moved_in_place_and_returned() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    out = on_device(model, device="meta")
    assert out is model
    assert all(p.device == META for p in model.parameters())
    assert all(b.device == META for b in model.buffers())


@pytest.fixture
def swap_params_on_conversion() -> Iterator[None]:
    """torch.__future__'s swap flag: Module.to keeps Parameter objects even to `meta`."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _model_and_sgd() -> tuple[torch.nn.Module, list[torch.nn.Parameter], torch.optim.SGD]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    params = list(model.parameters())
    return model, params, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _check_params_kept(model: torch.nn.Module, params: list[Any], opt: Any, dev: Any) -> None:
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert all(type(p) is torch.nn.Parameter and p.device == dev for p in params)
    # the optimizer still updates the model's parameters, not stale copies
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params, strict=True))


@pytest.mark.usefixtures("swap_params_on_conversion")
def test_module_move_keeps_parameter_objects_and_optimizer_links() -> None:
    model, params, opt = _model_and_sgd()
    on_device(model, opt, device="meta")
    _check_params_kept(model, params, opt, META)


@pytest.mark.usefixtures("swap_params_on_conversion")
def test_parameter_after_its_module_is_shared_not_copied() -> None:
    model = torch.nn.Linear(2, 2)
    weight = model.weight
    out = on_device({"model": model, "w": weight, "ws": [weight]}, device="meta")
    assert out["w"] is weight is model.weight  # moved in place with the module, shared
    assert out["ws"][0] is weight
    assert weight.device == META


def test_moved_in_place_follows_module_apply() -> None:
    # the prediction agrees with what Module.to really does, flag by flag
    for swap in (False, True):
        before = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(swap)
        try:
            model = torch.nn.Linear(2, 2)
            weight = model.weight
            predicted = handlers.moved_in_place(weight, META)
            model.to(META)
            assert predicted is (model.weight is weight) is swap
        finally:
            torch.__future__.set_swap_module_params_on_conversion(before)


def test_parameter_next_to_its_module_without_swap_flag() -> None:
    # Module.to("meta") gives the module new Parameters; the loose one is moved as well
    model = torch.nn.Linear(2, 2)
    out = on_device({"model": model, "w": model.weight}, device="meta")
    assert out["w"].device == META
    assert model.weight.device == META


def test_loss_module_with_buffers() -> None:
    loss = torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0]))
    out = on_device(loss, device="meta")
    assert out is loss
    assert loss.weight is not None
    assert loss.weight.device == META


def test_module_already_there_not_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(2, 2)
    called: list[object] = []
    monkeypatch.setattr(model, "to", lambda *a, **k: called.append(a))
    assert on_device(model, device="cpu") is model
    assert called == []


def test_module_in_container_keeps_container() -> None:
    model = torch.nn.Linear(2, 2)
    batch = [model, 3]
    out = on_device(batch, device="meta")
    assert out is batch  # the module moved in place; the list itself did not change
    assert model.weight.device == META


def test_meta_module_error_suggests_to_empty() -> None:
    model = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(
        ValueError,
        match=r"cannot move the Linear at obj\['model'\] to cpu: its parameter 'weight' is on "
        r"the meta device .* `module\.to_empty\(device='cpu'\)",
    ):
        on_device({"model": model}, device="cpu")


def test_meta_module_to_meta_is_fine() -> None:
    model = torch.nn.Linear(2, 2, device="meta")
    assert on_device(model, device="meta") is model


# --------------------------------------------------------------------- optimizers


def _adam(**kwargs: Any) -> tuple[torch.nn.Module, torch.optim.Adam]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), **kwargs)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_state_moved_in_place_step_stays_on_cpu() -> None:
    _model, opt = _adam()
    states = list(opt.state.values())
    out = on_device(opt, device="meta")
    assert out is opt
    assert list(opt.state.values()) == states  # the same state dicts, updated in place
    for s in opt.state.values():
        assert s["exp_avg"].device == META
        assert s["exp_avg_sq"].device == META
        assert s["step"].device.type == "cpu"  # torch wants the scalar step on the CPU


@pytest.mark.parametrize("flag", ["capturable", "fused"])
def test_optimizer_step_moves_when_capturable_or_fused(flag: str) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p])
    opt.param_groups[0][flag] = True
    opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2)}
    on_device(opt, device="meta")
    assert opt.state[p]["step"].device == META
    assert opt.state[p]["exp_avg"].device == META


def test_optimizer_nested_state_and_non_tensor_values() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    opt.state[p] = {"momentum_buffer": torch.ones(2), "history": [torch.ones(1)], "n": 3}
    on_device(opt, device="meta")
    assert opt.state[p]["momentum_buffer"].device == META
    assert opt.state[p]["history"][0].device == META
    assert opt.state[p]["n"] == 3


def test_model_and_optimizer_together_returns_tuple() -> None:
    model, opt = _adam()
    out = on_device(model, opt, device="meta")
    assert out == (model, opt)
    assert out[0] is model
    assert out[1] is opt


# --------------------------------------------------------------------- containers


class Point(NamedTuple):
    x: Any
    y: Any


@dataclasses.dataclass
class Batch:
    x: Any
    y: Any
    cached: Any = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        self.calls = getattr(self, "calls", 0) + 1


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenSlots:
    x: Any
    label: str = "a"


@dataclasses.dataclass
class Unset:
    x: Any
    later: Any = dataclasses.field(init=False)


class TaggedDict(dict[str, Any]):
    """A dict subclass with an instance attribute that must survive."""

    tag: str


class ReadOnlyMapping(Mapping[str, Any]):
    def __init__(self, data: dict[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, k: str) -> Any:
        return self._data[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def test_dict_list_tuple() -> None:
    t = torch.ones(1)
    obj = {"a": [t, (t, 1)], "b": "s"}
    out = on_device(obj, device="meta")
    assert type(out["a"]) is list
    assert type(out["a"][1]) is tuple
    assert out["a"][0].device == META
    assert out["b"] is obj["b"]


def test_ordereddict_and_defaultdict_keep_type_and_factory() -> None:
    od = OrderedDict([("b", torch.ones(1)), ("a", torch.ones(1))])
    dd: defaultdict[str, Any] = defaultdict(list, {"x": torch.ones(1)})
    out_od, out_dd = on_device(od, dd, device="meta")
    assert type(out_od) is OrderedDict
    assert list(out_od) == ["b", "a"]
    assert type(out_dd) is defaultdict
    assert out_dd.default_factory is list
    assert out_dd["x"].device == META
    assert dd["x"].device.type == "cpu"  # a new container, the input is untouched


def test_dict_subclass_keeps_attributes() -> None:
    d = TaggedDict(t=torch.ones(1))
    d.tag = "train"
    out = on_device(d, device="meta")
    assert type(out) is TaggedDict
    assert out.tag == "train"
    assert out["t"].device == META


def test_other_mappings() -> None:
    ro = ReadOnlyMapping({"t": torch.ones(1), "n": 1})
    out = on_device(ro, device="meta")
    assert type(out) is ReadOnlyMapping
    assert out["t"].device == META
    proxy = types.MappingProxyType({"t": torch.ones(1)})
    out_proxy = on_device(proxy, device="meta")
    assert type(out_proxy) is types.MappingProxyType
    assert out_proxy["t"].device == META


def test_namedtuple() -> None:
    out = on_device(Point(torch.ones(1), "y"), device="meta")
    assert type(out) is Point
    assert out.x.device == META
    assert out.y == "y"


def test_sets() -> None:
    t = torch.ones(1)
    for kind in (set, frozenset):
        out = on_device(kind([t, 1]), device="meta")
        assert type(out) is kind
        assert {type(v) for v in out} == {torch.Tensor, int}
        assert next(v for v in out if isinstance(v, torch.Tensor)).device == META


def test_dataclasses_frozen_slots_and_init_false() -> None:
    b = Batch(torch.ones(1), "y")
    b.cached = torch.zeros(1)
    out = on_device(b, device="meta")
    assert type(out) is Batch
    assert out.x.device == META
    assert out.cached.device == META
    assert out.calls == 1  # __post_init__ did not run again
    assert b.x.device.type == "cpu"
    fz = on_device(FrozenSlots(torch.ones(1)), device="meta")
    assert fz.x.device == META
    assert fz.label == "a"
    unset = on_device(Unset(torch.ones(1)), device="meta")
    assert unset.x.device == META
    assert not hasattr(unset, "later")


def test_frozen_dataclass_from_strategies() -> None:
    out = on_device(Frozen(Record(Pair(torch.ones(1), 2))), device="meta")
    assert out.value.value.first.device == META
    assert out.value.note == "note"


class HasTo:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.calls: list[dict[str, Any]] = []

    def to(self, device: torch.device, non_blocking: bool = False) -> HasTo:
        self.calls.append({"device": device, "non_blocking": non_blocking})
        return HasTo(self.t.to(device))


class HasOldTo:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: torch.device) -> HasOldTo:
        return HasOldTo(self.t.to(device))


def test_objects_with_to() -> None:
    obj = HasTo(torch.ones(1))
    out = on_device({"o": obj}, device="meta")["o"]
    assert out.t.device == META
    assert obj.calls == [{"device": META, "non_blocking": False}]


def test_objects_whose_to_rejects_non_blocking() -> None:
    out = on_device(HasOldTo(torch.ones(1)), device="meta", non_blocking=True)
    assert out.t.device == META


def test_a_to_that_raises_type_error_is_not_called_twice() -> None:
    calls: list[object] = []

    class Picky:
        def to(self, device: torch.device, non_blocking: bool = False) -> Picky:
            calls.append(device)
            raise TypeError("Picky.to wants a dtype too")

    with pytest.raises(TypeError, match="Picky.to wants a dtype too"):
        on_device([Picky()], device="meta")
    assert calls == [META]


def test_other_leaves_are_the_same_objects() -> None:
    arr = np.ones(3)
    leaves = [1, 2.5, "s", b"b", None, arr, torch.float16, object(), np.float32(1.0)]
    out = on_device([*leaves, torch.ones(1)], device="meta")
    assert all(a is b for a, b in zip(out, leaves, strict=False))


# ----------------------------------------------------------- aliasing and identity


def test_aliasing_one_copy_per_tensor() -> None:
    t = torch.ones(2)
    u = torch.ones(2)
    obj: dict[str, Any] = {"a": t, "b": [t, u], "c": (t,), "d": Point(u, t)}
    out = on_device(obj, device="meta")
    assert out["a"] is out["b"][0] is out["c"][0] is out["d"].y
    assert out["b"][1] is out["d"].x
    assert out["a"] is not out["b"][1]


def test_shared_containers_stay_shared() -> None:
    inner = [torch.ones(1)]
    out = on_device({"a": inner, "b": inner}, device="meta")
    assert out["a"] is out["b"]


def test_aliasing_across_several_objects() -> None:
    t = torch.ones(2)
    a, b = on_device([t], {"t": t}, device="meta")
    assert a[0] is b["t"]


def test_nothing_to_move_returns_same_containers() -> None:
    batch: dict[str, Any] = {
        "x": torch.ones(2),
        "ids": [1, 2],
        "nested": (torch.zeros(1), {"k": "v"}),
    }
    assert on_device(batch, device="cpu") is batch
    moved = on_device(batch, device="meta")
    assert on_device(moved, device="meta") is moved
    assert moved["ids"] is batch["ids"]  # a sub-container without tensors is reused
    assert moved["nested"][1] is batch["nested"][1]


# ------------------------------------------------------------ non_blocking policy


@pytest.mark.parametrize(
    ("target", "requested", "expected_nb", "expected_track"),
    [
        (torch.device("cuda", 0), None, True, False),
        (torch.device("mps"), None, False, False),  # pytorch/pytorch#83015
        (torch.device("cpu"), None, False, False),
        (torch.device("meta"), None, False, False),
        (torch.device("cpu"), True, True, True),
        (torch.device("cuda", 0), False, False, False),
    ],
)
def test_non_blocking_policy(
    target: torch.device, requested: bool | None, expected_nb: bool, expected_track: bool
) -> None:
    ctx = tree.Ctx(target, requested)
    assert ctx.nb is expected_nb
    assert ctx.track is expected_track


def test_forced_non_blocking_to_cpu_waits_for_the_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(d))
    ctx = tree.Ctx(torch.device("cpu"), True)
    ctx.sync.add(torch.device("cuda", 1))
    tree.finish(ctx)
    assert synced == [torch.device("cuda", 1)]


def test_forced_non_blocking_to_cpu_calls_duck_to_synchronously() -> None:
    obj = HasTo(torch.ones(1))
    on_device(obj, device="cpu", non_blocking=True)
    assert obj.calls[0]["non_blocking"] is False


def test_non_blocking_passed_to_duck_when_forced() -> None:
    obj = HasTo(torch.ones(1))
    on_device(obj, device="meta", non_blocking=True)
    assert obj.calls[0]["non_blocking"] is True


def test_non_blocking_must_be_bool_or_none() -> None:
    with pytest.raises(TypeError, match=r"non_blocking=\.\.\.\) expects None .* got str 'yes'"):
        on_device(torch.ones(1), device="meta", non_blocking="yes")  # type: ignore[call-overload]


# ------------------------------------------------------------------------- errors


def test_generator_error_points_to_prefetch() -> None:
    gen = (torch.ones(1) for _ in range(2))
    with pytest.raises(
        TypeError,
        match=r"cannot move a generator \(found at obj\['data'\]\[1\]\).*"
        r"cudakit\.data\.prefetch\(loader\)",
    ):
        on_device({"data": [1, gen]}, device="meta")
    assert next(gen).device.type == "cpu"  # not consumed


def test_iterator_error() -> None:
    with pytest.raises(
        TypeError, match=r"cannot move an iterator \(list_iterator\) \(found at obj\)"
    ):
        on_device(iter([torch.ones(1)]), device="meta")


@pytest.mark.parametrize(
    ("make", "where"),
    [
        (lambda t: t, "obj"),
        (lambda t: [1, t], r"obj\[1\]"),
        (lambda t: {"a": (0, {"b": t})}, r"obj\['a'\]\[1\]\['b'\]"),
        (lambda t: Record(Pair(t, 1)), r"obj\.value\[0\]"),
        (lambda t: OrderedDict(x=[t]), r"obj\['x'\]\[0\]"),
        (lambda t: frozenset([t]), r"obj\{\.\.\.\}"),
        (lambda t: torch.nn.Parameter(t), "obj"),
    ],
)
def test_meta_tensor_error_names_where(make: Any, where: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"cannot copy the tensor at {where} from the meta device to cpu: "
        r".*`torch\.empty_like",
    ) as info:
        on_device(make(torch.ones(1, device="meta")), device="cpu")
    assert isinstance(info.value.__cause__, NotImplementedError)  # torch's own error kept


def test_other_not_implemented_errors_pass_through() -> None:
    class Unsupported:
        def to(self, device: torch.device, non_blocking: bool = False) -> None:
            raise NotImplementedError("no such backend")

    with pytest.raises(NotImplementedError, match="no such backend"):
        on_device([Unsupported()], device="meta")


def test_packed_sequence_uses_its_to() -> None:
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.ones(3, 2, 4), [3, 2])
    out = on_device(packed, device="meta")
    assert type(out) is torch.nn.utils.rnn.PackedSequence
    assert out.data.device == META


def test_dataloader_error() -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)))
    with pytest.raises(
        TypeError,
        match=r"cannot move a DataLoader \(found at obj\).*cudakit\.data\.prefetch\(loader\)",
    ):
        on_device(loader, device="meta")


def test_cycle_error_names_where() -> None:
    loop: list[Any] = [torch.ones(1)]
    loop.append({"again": loop})
    with pytest.raises(
        ValueError, match=r"reference cycle: obj\[1\]\['again'\] refers back to obj \(a list"
    ):
        on_device(loop, device="meta")


def test_cycle_error_deeper_and_through_dataclass() -> None:
    rec = Record(None)
    rec.value = {"self": rec}
    with pytest.raises(
        ValueError,
        match=r"reference cycle: objs\[1\]\.value\['self'\] refers back to objs\[1\] "
        r"\(a Record",
    ):
        on_device(torch.ones(1), rec, device="meta")


def test_errors_leave_input_untouched() -> None:
    model = torch.nn.Linear(2, 2)
    _m, opt = _adam()
    loop: list[Any] = []
    loop.append(loop)
    bad_inputs: list[Any] = [loop, (x for x in [1]), torch.nn.Linear(1, 1, device="meta")]
    for bad in bad_inputs:
        # a meta module only fails when it has to leave the meta device
        target = "cpu" if isinstance(bad, torch.nn.Module) else "meta"
        with pytest.raises((TypeError, ValueError), match="on_device()"):
            on_device([model, opt, bad], device=target)
        assert model.weight.device.type == "cpu"
        assert all(s["exp_avg"].device.type == "cpu" for s in opt.state.values())


def test_container_that_cannot_be_rebuilt() -> None:
    class Strict(tuple):  # type: ignore[type-arg]
        def __new__(cls, a: Any, b: Any) -> Strict:
            return super().__new__(cls, (a, b))

    with pytest.raises(
        TypeError, match=r"cannot rebuild a Strict from them: Strict\(items\) raised TypeError"
    ):
        on_device(Strict(torch.ones(1), 2), device="meta")


class CheckedPoint(NamedTuple):
    x: Any
    y: Any


class StrictPoint(CheckedPoint):
    def __new__(cls, x: Any, y: Any) -> StrictPoint:
        if isinstance(x, torch.Tensor) and x.is_meta:
            raise ValueError("x must hold data")
        return super().__new__(cls, x, y)


class NoArgsMapping(ReadOnlyMapping):
    def __init__(self) -> None:
        super().__init__({"t": torch.ones(1)})


class FrozenList(list):  # type: ignore[type-arg]
    def __setitem__(self, i: Any, v: Any) -> None:
        raise TypeError("FrozenList is read-only")


@pytest.mark.parametrize(
    ("obj", "where", "how"),
    [
        (
            {"p": StrictPoint(torch.ones(1), 2)},
            r"obj\['p'\]",
            r"StrictPoint\(\*fields\) raised ValueError: x must hold data",
        ),
        ([0, NoArgsMapping()], r"obj\[1\]", r"NoArgsMapping\(dict\) raised TypeError"),
        (
            Record(FrozenList([torch.ones(1)])),
            r"obj\.value",
            r"copy\.copy\(obj\)\[:\] = items raised TypeError: FrozenList is read-only",
        ),
    ],
)
def test_rebuild_errors_name_the_container_where_and_how(obj: Any, where: str, how: str) -> None:
    with pytest.raises(TypeError, match=rf"inside the \w+ at {where} but cannot rebuild .*{how}"):
        on_device(obj, device="meta")


def test_bad_device_errors_come_from_resolve_device() -> None:
    with pytest.raises(DeviceError, match="did you mean 'cuda'"):
        on_device(torch.ones(1), device="gpu")


# -------------------------------------------------------------------------- forms


def test_decorator_bare() -> None:
    @on_device
    def f(x: torch.Tensor, *, y: torch.Tensor) -> tuple[torch.device, torch.device]:
        """Doc."""
        return x.device, y.device

    assert f(torch.ones(1), y=torch.ones(1)) == (resolve_device(), resolve_device())
    assert f.__name__ == "f"
    assert f.__doc__ == "Doc."
    assert hasattr(f, "__wrapped__")


def test_decorator_with_positional_device() -> None:
    @on_device("meta")
    def f(x: Any, *, y: Any = None) -> Any:
        return x, y

    x, y = f([torch.ones(1)], y={"k": torch.ones(1)})
    assert x[0].device == META
    assert y["k"].device == META


def test_decorator_with_keyword_device() -> None:
    deco = on_device(device="meta", non_blocking=False)
    assert isinstance(deco, OnDeviceDecorator)
    assert "meta" in repr(deco)

    @deco
    def f(x: torch.Tensor) -> torch.device:
        return x.device

    assert f(torch.ones(1)) == META


def test_decorator_on_method_leaves_self_alone() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        @on_device("meta")
        def where(self, x: torch.Tensor) -> torch.device:
            return x.device

    net = Net()
    assert net.where(torch.ones(2)) == META
    assert net.lin.weight.device.type == "cpu"


def test_decorator_on_coroutine() -> None:
    @on_device("meta")
    async def f(x: torch.Tensor) -> torch.device:
        return x.device

    assert asyncio.run(f(torch.ones(1))) == META


def test_decorator_errors_name_the_function() -> None:
    @on_device("meta")
    def f(x: Any) -> Any:
        return x

    with pytest.raises(TypeError, match=r"cannot move a generator \(found at .*f\(\) args\[0\]"):
        f(x for x in [1])
    with pytest.raises(TypeError, match=r"\(found at .*f\(\) kwargs\['x'\]\[1\]\)"):
        f(x=[1, iter([])])


def test_decorator_misuse() -> None:
    deco = on_device(device="meta")
    with pytest.raises(
        TypeError,
        match=r"on_device\(func=\.\.\.\) expects a function to decorate, got int 3\. Write",
    ):
        deco(3)  # type: ignore[arg-type]
    with pytest.raises(DeviceError, match="did you mean 'cuda'"):
        on_device("gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_decorating_for_missing_cuda_fails_at_call_time_not_import_time() -> None:
    @on_device("cuda")
    def f(x: Any) -> Any:
        return x

    with pytest.raises(DeviceError, match="asks for CUDA, but CUDA is not available"):
        f(torch.ones(1))


@pytest.mark.parametrize("device", [1.5, True, [0]])
def test_decorator_bad_device_type(device: Any) -> None:
    with pytest.raises(TypeError, match="device must be a torch.device"):
        on_device(device=device)


def test_decorator_negative_index_fails_at_decoration() -> None:
    with pytest.raises(DeviceError, match="negative CUDA index"):
        on_device(device=-1)


def test_decorator_keeps_the_signature() -> None:
    def f(x: torch.Tensor, /, y: int = 2, *, z: Any = None) -> int:
        return y

    wrapped = on_device("meta")(f)
    assert inspect.signature(wrapped) == inspect.signature(f)
    assert wrapped.__annotations__ == f.__annotations__


class WithMethods:
    """@on_device above and below staticmethod/classmethod, bare and with a device."""

    @on_device("meta")
    @staticmethod
    def static_below(x: torch.Tensor) -> torch.device:
        return x.device

    @staticmethod
    @on_device("meta")
    def static_above(x: torch.Tensor) -> torch.device:
        return x.device

    @on_device
    @staticmethod
    def static_bare(x: torch.Tensor) -> torch.device:
        return x.device

    @on_device("meta")
    @classmethod
    def class_below(klass, x: torch.Tensor) -> tuple[type, torch.device]:
        return klass, x.device

    @on_device(device="meta")
    @classmethod
    def class_kw(cls, x: torch.Tensor) -> tuple[type, torch.device]:
        return cls, x.device


@pytest.mark.parametrize("via_instance", [False, True])
def test_decorator_on_static_and_class_methods(via_instance: bool) -> None:
    owner: Any = WithMethods() if via_instance else WithMethods
    t = torch.ones(1)
    assert owner.static_below(t) == META
    assert owner.static_above(t) == META
    assert owner.static_bare(t) == resolve_device()
    assert isinstance(WithMethods.__dict__["static_bare"], staticmethod)
    assert owner.class_below(t) == (WithMethods, META)  # the class is not moved
    assert owner.class_kw(t) == (WithMethods, META)


def test_no_arguments_gives_a_decorator() -> None:
    assert isinstance(on_device(), OnDeviceDecorator)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_cuda_batch_and_pinned_memory() -> None:
    cuda = resolve_device("cuda")
    batch: dict[str, Any] = {
        "x": torch.randn(64, 128).pin_memory(),
        "y": torch.arange(64),
        "ids": ["a"],
    }
    out = on_device(batch, device="cuda")
    torch.cuda.synchronize()
    assert out["x"].device == cuda
    assert torch.equal(out["x"].cpu(), batch["x"])
    assert torch.equal(out["y"].cpu(), batch["y"])
    assert out["ids"] is batch["ids"]
    assert on_device(out, device="cuda") is out


@pytest.mark.cuda
def test_cuda_to_cpu_forced_non_blocking_is_safe_to_read() -> None:
    x = torch.randn(4096, 1024, device="cuda")
    y = x * 2  # queued work that the copy must wait for
    out = on_device({"y": y}, device="cpu", non_blocking=True)
    assert out["y"].device.type == "cpu"
    assert torch.equal(out["y"], (x * 2).cpu())


@pytest.mark.cuda
def test_cuda_model_and_optimizer_step_works_after_move() -> None:
    model, opt = _adam()
    on_device(model, opt, device="cuda")
    for s in opt.state.values():
        assert s["exp_avg"].is_cuda
        assert s["step"].device.type == "cpu"
    model(torch.ones(1, 3, device="cuda")).sum().backward()
    opt.step()  # torch accepts the layout on_device produced
    assert next(iter(opt.state.values()))["step"].item() == 2


@pytest.mark.cuda
def test_cuda_capturable_optimizer_step_moves_with_params() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), capturable=True)
    for p in model.parameters():
        opt.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    on_device(model, opt, device="cuda")
    for s in opt.state.values():
        assert s["step"].is_cuda
    model(torch.ones(1, 3, device="cuda")).sum().backward()
    opt.step()


@pytest.mark.cuda
def test_cuda_module_move_keeps_parameter_objects_and_shares_them() -> None:
    model, params, opt = _model_and_sgd()
    weight = params[0]
    _m, out, _o = on_device(model, {"w": weight}, opt, device="cuda")
    _check_params_kept(model, params, opt, resolve_device("cuda"))
    assert out["w"] is weight  # not a second copy on the GPU


@pytest.mark.cuda
def test_cuda_parameter_with_grad() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    m = on_device(p, device="cuda")
    assert type(m) is torch.nn.Parameter
    assert m.is_cuda
    assert m.grad is not None
    assert m.grad.is_cuda
