"""Tests for cudakit.data: prefetch() and loader_kwargs()."""

from __future__ import annotations

import collections
import dataclasses
import gc
import multiprocessing
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Frozen, Pair, Record, nested
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    TensorDataset,
)

from cudakit._tree import Staging, move_root
from cudakit.data import (
    Prefetcher,
    SizedPrefetcher,
    loader_kwargs,
    prefetch,
)
from cudakit.data.loaders import MAX_AUTO_WORKERS, _choose_loader_kwargs
from cudakit.data.prefetcher import _LookaheadIterator
from cudakit.exceptions import DeviceError


def _settles(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    """True once ``check()`` holds: helper threads and processes exit a little late."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _threads_settle_to(baseline: set[threading.Thread]) -> bool:
    """True once no thread outside ``baseline`` is alive (daemon queue feeders exit late)."""
    return _settles(lambda: set(threading.enumerate()) <= baseline)


def _children_settle_to(baseline: set[Any]) -> bool:
    """True once no child process outside ``baseline`` is alive (a worker may be terminated
    after its join timed out, and be reaped a moment later)."""
    return _settles(lambda: set(multiprocessing.active_children()) <= baseline)


def assert_same(a: Any, b: Any) -> None:
    """Structural equality: same container types, equal tensors on the same device."""
    assert type(a) is type(b)
    if a is b:
        return
    if isinstance(a, torch.Tensor):
        assert a.device == b.device
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple, collections.deque)):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            assert_same(u, v)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


def drain(batches: Any, into: list[Any]) -> None:
    """Append every batch to ``into`` until the iterable ends or raises."""
    for b in batches:
        into.append(b)


# -- prefetch on the CPU: a plain moving iterator -------------------------------------


@given(st.lists(nested(max_leaves=8), max_size=4))
def test_every_batch_type_round_trips_in_order(source: list[Any]) -> None:
    wrapped = prefetch(source, device="cpu")
    assert len(wrapped) == len(source)
    out = list(wrapped)
    assert len(out) == len(source)
    for got, want in zip(out, source, strict=True):
        assert_same(got, want)


@pytest.mark.parametrize(
    "batch",
    [torch.ones(2), (torch.ones(2), torch.zeros(1)), [torch.ones(1)], {"x": torch.ones(1)}],
    ids=["tensor", "tuple", "list", "dict"],
)
def test_cpu_batches_already_in_place_come_back_as_themselves(batch: Any) -> None:
    (out,) = prefetch([batch], device="cpu")
    assert out is batch


def test_cpu_batches_that_need_moving_are_moved() -> None:
    batch = {"x": torch.ones(2), "n": 3}
    (out,) = prefetch([batch], device="meta")
    assert out["x"].device.type == "meta"
    assert out["n"] == 3
    (same,) = prefetch([batch], device="cpu")  # not a flat batch of tensors: on_device
    assert same is batch


def test_dataloader_batches_match_a_plain_loop_and_len_is_kept() -> None:
    ds = TensorDataset(torch.randn(10, 3), torch.arange(10))
    loader = DataLoader(ds, batch_size=4)
    wrapped = prefetch(loader, device="cpu")
    assert isinstance(wrapped, SizedPrefetcher)
    assert len(wrapped) == len(loader) == 3
    for got, want in zip(wrapped, loader, strict=True):
        assert_same(got, want)


def test_generator_source_has_no_len_and_is_consumed_once() -> None:
    gen = (torch.full((2,), i) for i in range(3))
    wrapped = prefetch(gen, device="cpu")
    assert type(wrapped) is Prefetcher
    assert not hasattr(wrapped, "__len__")
    with pytest.raises(TypeError):
        len(wrapped)  # type: ignore[arg-type]
    assert [int(b[0]) for b in wrapped] == [0, 1, 2]
    assert list(wrapped) == []


def test_second_epoch_iterates_again_with_fresh_state() -> None:
    loader = DataLoader(TensorDataset(torch.arange(6)), batch_size=2)
    wrapped = prefetch(loader, device="cpu")
    first = [b[0].tolist() for b in wrapped]
    # A broken-off epoch does not disturb the next one.
    for _ in wrapped:
        break
    second = [b[0].tolist() for b in wrapped]
    assert first == second == [[0, 1], [2, 3], [4, 5]]


def test_two_iterators_are_independent() -> None:
    wrapped = prefetch([torch.tensor(i) for i in range(3)], device="cpu")
    a, b = iter(wrapped), iter(wrapped)
    assert int(next(a)) == 0
    assert [int(t) for t in b] == [0, 1, 2]
    assert [int(t) for t in a] == [1, 2]


@pytest.mark.parametrize(
    "source",
    [[], DataLoader(TensorDataset(torch.empty(0, 2)), batch_size=4)],
    ids=["list", "dataloader"],
)
def test_empty_loader(source: Any) -> None:
    wrapped = prefetch(source, device="cpu")
    assert len(wrapped) == 0
    assert list(wrapped) == []
    assert list(wrapped) == []


def test_iterable_dataset_loader_without_len() -> None:
    class Stream(IterableDataset[torch.Tensor]):
        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter(torch.arange(5).split(1))

    loader = DataLoader(Stream(), batch_size=2)
    wrapped = prefetch(loader, device="cpu")
    with pytest.raises(TypeError):
        len(wrapped)  # the DataLoader itself has no length either
    assert [b.tolist() for b in wrapped] == [[[0], [1]], [[2], [3]], [[4]]]


class Tracked:
    """A re-iterable source whose iterators say when they are finished with."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n = n
        self.fail_at = fail_at
        self.closed = 0
        self.iterators: list[weakref.ref[Iterator[torch.Tensor]]] = []
        self.made: list[weakref.ref[torch.Tensor]] = []

    def _gen(self) -> Iterator[torch.Tensor]:
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise KeyError(f"bad sample {i}")
                batch = torch.full((4,), float(i))
                self.made.append(weakref.ref(batch))
                yield batch
                del batch
        finally:
            self.closed += 1

    def __iter__(self) -> Iterator[torch.Tensor]:
        gen = self._gen()
        self.iterators.append(weakref.ref(gen))
        return gen

    def __len__(self) -> int:
        return self.n


def test_early_break_releases_the_source_iterator() -> None:
    source = Tracked(5)
    threads = set(threading.enumerate())
    for i, _ in enumerate(prefetch(source, device="cpu")):
        if i == 1:
            break
    assert source.closed == 1
    assert source.iterators[0]() is None
    assert _threads_settle_to(threads)


def test_close_releases_a_held_iterator() -> None:
    source = Tracked(5)
    it = iter(prefetch(source, device="cpu"))
    next(it)
    it.close()  # type: ignore[attr-defined]
    assert source.closed == 1
    gc.collect()
    assert source.iterators[0]() is None
    with pytest.raises(StopIteration):
        next(it)


def test_exception_in_source_propagates_and_releases() -> None:
    source = Tracked(5, fail_at=2)
    seen: list[torch.Tensor] = []
    it = iter(prefetch(source, device="cpu"))
    with pytest.raises(KeyError, match="bad sample 2"):
        drain(it, seen)
    assert [int(b[0]) for b in seen] == [0, 1]
    assert source.closed == 1
    with pytest.raises(StopIteration):
        next(it)
    # The next epoch starts fresh.
    source.fail_at = None
    assert len(list(prefetch(source, device="cpu"))) == 5


def test_an_iterator_passed_in_stays_the_users_to_resume() -> None:
    gen = iter([torch.tensor(i) for i in range(4)])
    for _ in prefetch(gen, device="cpu"):
        break
    assert [int(t) for t in gen] == [1, 2, 3]


def test_dataloader_workers_are_released_on_break() -> None:
    loader = DataLoader(
        TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=1, prefetch_factor=2
    )
    threads = set(threading.enumerate())
    children = set(multiprocessing.active_children())
    for i, _ in enumerate(prefetch(loader, device="cpu")):
        if i == 1:
            break
    assert _children_settle_to(children)
    assert _threads_settle_to(threads)


def train_until_nan(batches: Any, at: int) -> None:
    """A loop whose body raises at batch ``at``."""
    for i, _ in enumerate(batches):
        if i == at:
            raise ZeroDivisionError("loss is nan")


def test_an_exception_in_the_loop_body_releases_the_source() -> None:
    source = Tracked(5)
    with pytest.raises(ZeroDivisionError):
        train_until_nan(prefetch(source, device="cpu"), at=1)
    assert source.closed == 1
    assert source.iterators[0]() is None
    gc.collect()
    assert [r() for r in source.made] == [None, None]  # no batch outlives the loop


def test_dataloader_workers_are_released_when_the_loop_body_raises() -> None:
    loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=1)
    threads = set(threading.enumerate())
    children = set(multiprocessing.active_children())
    with pytest.raises(ZeroDivisionError):
        train_until_nan(prefetch(loader, device="cpu"), at=0)
    assert _children_settle_to(children)
    assert _threads_settle_to(threads)


def test_repr_and_properties() -> None:
    src = [torch.zeros(1)]
    wrapped = prefetch(src, device="cpu", depth=3)
    assert wrapped.loader is src
    assert wrapped.device == torch.device("cpu")
    assert wrapped.depth == 3
    assert repr(wrapped) == "SizedPrefetcher(list, device='cpu', depth=3)"


def test_prefetch_of_a_prefetcher_keeps_len_and_epochs() -> None:
    ds = TensorDataset(torch.arange(8))
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True)
    inner = prefetch(DataLoader(ds, sampler=sampler, batch_size=2), device="cpu")
    outer = prefetch(inner, device="cpu")
    assert len(outer) == 2
    outer.set_epoch(5)
    assert sampler.epoch == 5


# -- set_epoch -------------------------------------------------------------------------


def test_set_epoch_reaches_a_distributed_sampler_and_reshuffles() -> None:
    ds = TensorDataset(torch.arange(16))
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=0)
    wrapped = prefetch(DataLoader(ds, sampler=sampler, batch_size=8), device="cpu")
    wrapped.set_epoch(0)
    epoch0 = [b[0].tolist() for b in wrapped]
    wrapped.set_epoch(1)
    epoch1 = [b[0].tolist() for b in wrapped]
    assert sampler.epoch == 1
    assert epoch0 != epoch1


def test_set_epoch_reaches_a_sampler_inside_a_batch_sampler() -> None:
    ds = TensorDataset(torch.arange(8))
    sampler = DistributedSampler(ds, num_replicas=2, rank=0)
    loader = DataLoader(ds, batch_sampler=BatchSampler(sampler, batch_size=2, drop_last=False))
    prefetch(loader, device="cpu").set_epoch(7)
    assert sampler.epoch == 7


def test_set_epoch_prefers_the_sources_own_method() -> None:
    class Source(list[torch.Tensor]):
        epochs: list[int]

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

    src = Source([torch.zeros(1)])
    src.epochs = []
    prefetch(src, device="cpu").set_epoch(2)
    assert src.epochs == [2]


def test_set_epoch_without_any_sampler_is_a_no_op() -> None:
    prefetch(DataLoader(range(4), shuffle=True), device="cpu").set_epoch(1)
    prefetch([1, 2], device="cpu").set_epoch(1)


@pytest.mark.parametrize("epoch", [1.0, "1", True, None])
def test_set_epoch_rejects_non_int(epoch: Any) -> None:
    with pytest.raises(
        TypeError, match=r"Prefetcher\.set_epoch\(epoch=\.\.\.\) expects an int >= 0, got"
    ):
        prefetch([1], device="cpu").set_epoch(epoch)


# -- argument errors -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "match"),
    [
        (torch.zeros(3, 2), r"got a single torch.Tensor of shape \(3, 2\).*on_device\(tensor\)"),
        ({"x": torch.zeros(1)}, r"got a dict, which looks like a single batch.*its keys"),
        ("abc", r"expects an iterable of batches .* got str 'abc', .* a list of batches"),
        (b"ab", r"got bytes b'ab', which would iterate character by character"),
        (5, r"got int 5, which is not iterable\. Pass the DataLoader itself"),
        (None, r"got NoneType None, which is not iterable"),
    ],
)
def test_bad_sources_are_clear_errors(source: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        prefetch(source)


@pytest.mark.parametrize("depth", [2.0, "2", True, None])
def test_depth_must_be_an_int(depth: Any) -> None:
    with pytest.raises(
        TypeError, match=r"prefetch\(depth=\.\.\.\) expects an int >= 1, got .* the default depth=2"
    ):
        prefetch([], device="cpu", depth=depth)


@pytest.mark.parametrize("depth", [0, -1])
def test_depth_must_be_positive(depth: int) -> None:
    with pytest.raises(
        ValueError, match=rf"depth=\.\.\.\) expects an int >= 1, got int {depth}\. .*Use depth=1"
    ):
        prefetch([], device="cpu", depth=depth)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_explicit_cuda_on_a_cpu_machine_is_a_device_error() -> None:
    with pytest.raises(DeviceError, match="CUDA is not available"):
        prefetch([], device="cuda")


def test_on_device_of_a_generator_points_at_prefetch() -> None:
    from cudakit.device import on_device

    with pytest.raises(TypeError, match="prefetch"):
        on_device(x for x in [torch.zeros(1)])


# -- the look-ahead machinery that the CUDA path uses, tested with a fake stage -------


class FakeStaging(_LookaheadIterator[Any]):
    """Stages by wrapping in a list (a stand-in for "copy started"), records the log."""

    def __init__(self, source: Iterator[Any], depth: int, stage_fail: Any = None) -> None:
        super().__init__(source, depth, owns=True)
        self.log: list[str] = []
        self.stage_fail = stage_fail

    def _stage(self, raw: Any) -> Any:
        if raw == self.stage_fail:
            raise ValueError(f"cannot stage {raw}")
        self.log.append(f"stage {raw}")
        return [raw]

    def _deliver(self, staged: Any) -> Any:
        self.log.append(f"deliver {staged[0]}")
        return staged[0]


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_lookahead_keeps_depth_batches_in_flight(depth: int) -> None:
    it = FakeStaging(iter(range(6)), depth)
    assert it.log == []  # nothing starts before the first next()
    assert next(it) == 0
    staged_ahead = [e for e in it.log if e.startswith("stage")]
    assert len(staged_ahead) == min(6, depth + 1)
    assert list(it) == [1, 2, 3, 4, 5]
    assert it.log.index("stage 5") < it.log.index("deliver 5")
    assert [e for e in it.log if e.startswith("deliver")] == [f"deliver {i}" for i in range(6)]


def test_lookahead_raises_a_source_error_after_the_batches_before_it() -> None:
    def source() -> Iterator[int]:
        yield 0
        yield 1
        raise KeyError("boom")

    it = FakeStaging(source(), depth=3)
    got = []
    with pytest.raises(KeyError, match="boom"):
        drain(it, got)
    assert got == [0, 1]
    with pytest.raises(StopIteration):
        next(it)


def test_lookahead_raises_a_staging_error_in_order() -> None:
    it = FakeStaging(iter(range(5)), depth=2, stage_fail=2)
    assert next(it) == 0
    assert next(it) == 1
    with pytest.raises(ValueError, match="cannot stage 2"):
        next(it)
    assert it._queue == collections.deque()


def test_lookahead_keyboard_interrupt_is_immediate_and_releases() -> None:
    def source() -> Iterator[torch.Tensor]:
        yield torch.zeros(1)
        yield torch.ones(1)
        raise KeyboardInterrupt

    it = FakeStaging(source(), depth=4)
    with pytest.raises(KeyboardInterrupt):
        next(it)
    assert it._queue == collections.deque()
    assert it._source is None


def test_lookahead_close_drops_batches_in_flight() -> None:
    made: list[weakref.ref[torch.Tensor]] = []

    def source() -> Iterator[torch.Tensor]:
        for i in range(10):
            t = torch.full((1000,), float(i))
            made.append(weakref.ref(t))
            yield t

    gen = source()
    it = FakeStaging(gen, depth=3)
    first = next(it)
    assert len(made) == 4
    it.close()
    gc.collect()
    assert [r() is None for r in made] == [False, True, True, True]
    del first
    assert made[0]() is None
    assert gen.gi_frame is None  # the owned generator was closed


def test_lookahead_empty_source() -> None:
    it = FakeStaging(iter([]), depth=2)
    assert list(it) == []
    assert it.log == []


# -- pinning, in the one walk that moves a batch (pin_memory faked: no CUDA here) ----


META = torch.device("meta")


def stage(batch: Any) -> tuple[Any, Staging]:
    """What the CUDA prefetcher does to a batch, aimed at "meta": pin, copy, list."""
    staging = Staging(pin=True)
    return move_root(batch, META, True, "batch", staging), staging


@pytest.fixture
def fake_pinning(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    pinned: list[torch.Tensor] = []

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        out = self.clone()
        pinned.append(out)
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: False)
    return pinned


@given(nested(max_leaves=8))
def test_staging_keeps_structure_like_on_device(batch: Any) -> None:
    from cudakit.device import on_device

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "pin_memory", lambda self, device=None: self.clone())
        mp.setattr(torch.Tensor, "is_pinned", lambda self, device=None: False)
        staged, _ = stage(batch)
    assert_same_shape(staged, on_device(batch, device="meta"))


def assert_same_shape(a: Any, b: Any) -> None:
    """Same container types and leaves; tensors compared by device, dtype and shape."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert (a.device, a.dtype, a.shape) == (b.device, b.dtype, b.shape)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same_shape(a[k], b[k])
    elif isinstance(a, (list, tuple, collections.deque)):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            assert_same_shape(u, v)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same_shape(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, (set, frozenset)):
        assert len(a) == len(b)
    else:
        assert a == b


def test_staging_pins_through_special_containers(fake_pinning: list[torch.Tensor]) -> None:
    dd: collections.defaultdict[str, Any] = collections.defaultdict(list, a=torch.zeros(2))
    batch = {
        "dd": dd,
        "od": collections.OrderedDict(b=torch.ones(2)),
        "frozen": Frozen([torch.ones(3), torch.zeros(1)]),
        "record": Record(torch.full((2,), 7.0)),
        "pair": Pair(torch.ones(1), "label"),
    }
    out, staging = stage(batch)
    assert len(fake_pinning) == 6
    assert len(staging.created) == 6
    assert out["dd"].default_factory is list
    assert type(out["od"]) is collections.OrderedDict
    assert type(out["frozen"]) is Frozen
    assert out["frozen"].value[0] is staging.created[2]
    assert out["record"].value.device == META
    assert out["record"].note == "note"  # the init=False field is kept
    assert type(out["pair"]) is Pair
    assert out["pair"].second == "label"
    # The user's batch is untouched.
    assert batch["frozen"].value[0].device.type == "cpu"
    assert batch["dd"]["a"] is not out["dd"]["a"]


def test_staging_does_not_pin_what_is_pinned_already(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a DataLoader with pin_memory=True yields: copied straight from it.
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, device=None: 1 / 0)
    batch = [torch.zeros(2), (torch.ones(1), "label"), {"x": torch.ones(3), "n": 1}]
    out, staging = stage(batch)
    assert out[2]["x"].device == META
    assert len(staging.created) == 3


def test_staging_uses_a_custom_batchs_pin_memory(fake_pinning: list[torch.Tensor]) -> None:
    class CustomBatch:
        """The DataLoader's memory-pinning protocol: a pin_memory() method."""

        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

        def pin_memory(self) -> CustomBatch:
            return CustomBatch(self.x.pin_memory())

        def to(self, device: Any, non_blocking: bool = False) -> CustomBatch:
            return CustomBatch(self.x.to(device, non_blocking=non_blocking))

    batch = CustomBatch(torch.zeros(2))
    out, staging = stage({"b": batch, "cls": CustomBatch})
    assert len(fake_pinning) == 1
    assert out["b"].x.device == META
    assert staging.opaque == [out["b"]]  # searched for its tensors on delivery
    assert out["cls"] is CustomBatch  # a class is not a batch: left alone


def test_staging_does_not_pin_sparse_tensors(fake_pinning: list[torch.Tensor]) -> None:
    out, staging = stage((torch.zeros(3).to_sparse(),))
    assert out[0].device == META
    assert fake_pinning == []
    assert len(staging.created) == 1


def test_staging_pins_and_copies_a_shared_tensor_once(fake_pinning: list[torch.Tensor]) -> None:
    t = torch.zeros(3)
    out, staging = stage({"a": t, "b": [t], "p": torch.nn.Parameter(torch.ones(1))})
    assert len(fake_pinning) == 1  # the Parameter is copied as it is
    assert out["a"] is out["b"][0]
    assert type(out["p"]) is torch.nn.Parameter
    assert len(staging.created) == 2


def test_staging_notes_device_tensors_once_and_leaves_them() -> None:
    meta = torch.empty(2, device="meta")
    seen: list[str] = []
    staging = Staging(pin=True, on_device_tensor=lambda: seen.append("wait"))
    out = move_root(
        {"m": meta, "n": [meta, torch.empty(1, device="meta")]}, META, True, "b", staging
    )
    assert out["m"] is meta
    assert seen == ["wait"]
    assert staging.created == []


# -- loader_kwargs ---------------------------------------------------------------------


def test_loader_kwargs_on_cpu() -> None:
    kw = loader_kwargs("cpu")
    assert kw == {"num_workers": 0, "pin_memory": False, "persistent_workers": False}
    loader = DataLoader(TensorDataset(torch.arange(4)), batch_size=2, **kw)
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "mps", "meta"])
@pytest.mark.parametrize("cpus", [1, 2, 3, 8, 16, 64])
@pytest.mark.parametrize("local_world", [1, 2, 8])
def test_choose_loader_kwargs_table(device_type: str, cpus: int, local_world: int) -> None:
    kw = _choose_loader_kwargs(device_type, cpus, local_world)
    workers = kw["num_workers"]
    if device_type in ("cuda", "mps"):
        share = max(1, cpus // local_world)
        assert workers == min(MAX_AUTO_WORKERS, share - 1)
        # Workers plus the loop never oversubscribe a process's share of cores.
        assert workers + 1 <= share or workers == 0
    else:
        assert workers == 0
    assert kw["pin_memory"] is (device_type == "cuda")
    assert kw["persistent_workers"] is (workers > 0)


def test_loader_kwargs_reads_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    import cudakit.data.loaders as data

    monkeypatch.setattr(data, "_available_cpus", lambda: 16)
    monkeypatch.setattr(data, "resolve_device", lambda spec=None: torch.device("cuda", 0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert loader_kwargs() == {"num_workers": 3, "pin_memory": True, "persistent_workers": True}
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    assert loader_kwargs()["num_workers"] == MAX_AUTO_WORKERS
    kw = loader_kwargs(num_workers=0)
    assert kw == {"num_workers": 0, "pin_memory": True, "persistent_workers": False}
    assert loader_kwargs(pin_memory=False)["pin_memory"] is False
    assert loader_kwargs(persistent_workers=False)["persistent_workers"] is False


def test_loader_kwargs_overrides() -> None:
    assert loader_kwargs("cpu", num_workers=2) == {
        "num_workers": 2,
        "pin_memory": False,
        "persistent_workers": True,
    }
    kw = loader_kwargs("cpu", num_workers=2, persistent_workers=False)
    assert kw["persistent_workers"] is False
    assert loader_kwargs("cpu", pin_memory=False)["pin_memory"] is False


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"num_workers": 1.5}, TypeError, r"num_workers=...\) expects an int >= 0, got float 1.5"),
        ({"num_workers": True}, TypeError, r"expects an int >= 0, got bool True"),
        (
            {"num_workers": -1},
            ValueError,
            r"num_workers=...\) expects an int >= 0, got int -1.* pass 0",
        ),
        ({"pin_memory": 1}, TypeError, r"pin_memory=...\) expects True, False or None"),
        ({"persistent_workers": "yes"}, TypeError, r"persistent_workers=...\) expects True"),
        ({"pin_memory": True}, ValueError, r"only speeds up copies to a CUDA device.*'cpu'"),
        (
            {"persistent_workers": True},
            ValueError,
            r"persistent_workers=True\) needs worker processes.*Pass num_workers=N",
        ),
    ],
)
def test_loader_kwargs_errors(kwargs: dict[str, Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        loader_kwargs("cpu", **kwargs)


@pytest.mark.cuda
def test_loader_kwargs_for_cuda_pin_without_warnings() -> None:
    kw = loader_kwargs("cuda", num_workers=1)
    assert "pin_memory_device" not in kw  # deprecated: torch would warn (an error here)
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4, **kw)
    batches = list(loader)
    assert [b[0].is_pinned() for b in batches] == [True, True]
    assert [b[0].tolist() for b in prefetch(loader, device="cuda")] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    del loader, batches  # persistent workers end with the loader
    gc.collect()


def test_loader_kwargs_never_starts_cuda() -> None:
    loader_kwargs()
    assert not torch.cuda.is_initialized() or torch.cuda.is_available()


# -- CUDA ---------------------------------------------------------------------------------


def _big_loader(n: int, size: int, pin: bool) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, size, generator=g), torch.arange(n))
    return DataLoader(ds, batch_size=4, pin_memory=pin)


@pytest.mark.cuda
@pytest.mark.parametrize("pin", [False, True], ids=["pageable", "pinned-by-loader"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_cuda_batches_match_a_synchronous_copy(pin: bool, depth: int) -> None:
    loader = _big_loader(32, 1 << 16, pin)
    expected = [(x.to("cuda"), y.to("cuda")) for x, y in loader]
    wrapped = prefetch(loader, device="cuda", depth=depth)
    assert len(wrapped) == len(expected)
    w = torch.randn(1 << 16, 64, device="cuda")
    for (x, y), (ex, ey) in zip(wrapped, expected, strict=True):
        assert x.device.type == y.device.type == "cuda"
        # Use the batch at once on the compute stream, with no synchronisation.
        got = x @ w
        torch.testing.assert_close(got, ex @ w)
        torch.testing.assert_close(y, ey, rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_nested_batches_and_device_tensors() -> None:
    already = torch.arange(3, device="cuda") * 2  # produced on the compute stream
    source = [
        {"x": torch.randn(5, 7), "meta": Pair(torch.arange(5), "ok"), "dev": already},
        [Frozen([torch.ones(2), torch.zeros(3)]), Record(torch.ones(1)), "text"],
    ]
    for got, want in zip(prefetch(source, device="cuda"), source, strict=True):
        assert_same(got, on_cuda(want))


def on_cuda(obj: Any) -> Any:
    from cudakit.device import on_device

    return on_device(obj, device="cuda")


@pytest.mark.cuda
def test_cuda_consumer_on_a_user_stream() -> None:
    loader = _big_loader(16, 1 << 14, pin=False)
    expected = [x.to("cuda").sum().item() for x, _ in loader]
    s = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(s):
        for x, _ in prefetch(loader, device="cuda"):
            sums.append(x.sum())
    s.synchronize()
    assert [v.item() for v in sums] == expected


@pytest.mark.cuda
def test_cuda_freed_tensor_is_not_overwritten_while_in_use() -> None:
    # Batch 0 is freed by the user right after a slow kernel that reads it is queued;
    # the side stream then copies more batches of the same size. Without
    # record_stream the allocator would hand batch 0's memory to those copies
    # while the compute stream still has to read it.
    n, size = 8, 1 << 20
    source = [torch.full((size,), float(i)) for i in range(n)]
    it = iter(prefetch(source, device="cuda", depth=2))
    x = next(it)
    torch.cuda._sleep(200_000_000)  # keep the compute stream busy (~0.1 s)
    total = x.sum()
    del x
    rest = [next(it) for _ in range(n - 1)]  # copies that would reuse x's block
    assert total.item() == 0.0
    for i, t in enumerate(rest, start=1):
        assert t.min().item() == t.max().item() == float(i)


@pytest.mark.cuda
def test_cuda_early_break_releases_device_memory() -> None:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loader = [torch.randn(1 << 18) for _ in range(10)]
    for i, batch in enumerate(prefetch(loader, device="cuda", depth=4)):
        assert batch.is_cuda
        if i == 2:
            break
    del batch  # the loop variable still holds the last batch
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.cuda
def test_cuda_exception_in_the_loop_body_releases_device_memory() -> None:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    source = Tracked(10)
    with pytest.raises(ZeroDivisionError):
        train_until_nan(prefetch(source, device="cuda", depth=3), at=2)
    assert source.closed == 1
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.cuda
def test_cuda_depth_bounds_the_batches_in_flight() -> None:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    nbytes = (1 << 18) * 4
    it = iter(prefetch([torch.randn(1 << 18) for _ in range(10)], device="cuda", depth=3))
    first = next(it)
    # The batch handed out plus three copied ahead.
    assert torch.cuda.memory_allocated() - before == 4 * nbytes
    del first
    it.close()  # type: ignore[attr-defined]
    assert torch.cuda.memory_allocated() == before


@pytest.mark.cuda
def test_cuda_exception_in_source_after_good_batches() -> None:
    source = Tracked(6, fail_at=3)
    got = []
    with pytest.raises(KeyError, match="bad sample 3"):
        drain(prefetch(source, device="cuda", depth=4), got)
    assert [b[0].item() for b in got] == [0.0, 1.0, 2.0]
    assert source.closed == 1


# -- the CUDA iterator's stream protocol, checked on the CPU with fake streams -------


class FakeEvent:
    def __init__(self, stream: FakeStream, n: int) -> None:
        self.name = f"{stream.name}#{n}"


class FakeStream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.events = 0

    def record_event(self) -> FakeEvent:
        self.events += 1
        ev = FakeEvent(self, self.events)
        self.log.append(f"{self.name} record {ev.name}")
        return ev

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(f"{self.name} wait {event.name}")

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} wait_stream {other.name}")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run _CudaPrefetchIterator against fakes: "meta" plays the CUDA device."""
    import contextlib

    import cudakit.data.prefetcher as data

    log: list[str] = []
    compute = FakeStream("compute", log)
    current = [compute]

    @contextlib.contextmanager
    def stream(s: FakeStream) -> Iterator[None]:
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    def record_stream(self: torch.Tensor, s: FakeStream) -> None:
        log.append(f"record_stream numel={self.numel()} on {s.name}")

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream("side", log))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.device.type == "meta"))
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream, raising=False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, device=None: self.clone())
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: False)

    real_move_root = data.move_root

    def fake_move_root(
        obj: Any, device: Any, non_blocking: Any, root: str, staging: Any = None
    ) -> Any:
        assert non_blocking is True
        assert current[-1].name == "side"  # the copy is issued on the side stream
        log.append("copy")
        return real_move_root(obj, torch.device("meta"), True, root, staging)

    monkeypatch.setattr(data, "move_root", fake_move_root)
    monkeypatch.setattr(data, "resolve_device", lambda spec=None: torch.device("cuda", 0))
    return log


def test_cuda_protocol_each_batch_waits_for_its_own_copy(fake_cuda: list[str]) -> None:
    source = [{"x": torch.zeros(i + 1)} for i in range(3)]  # batch i has i + 1 elements
    it = iter(prefetch(source, device="cuda", depth=2))
    first = next(it)
    assert first["x"].device.type == "meta"
    assert fake_cuda == [
        "copy",
        "side record side#1",
        "copy",
        "side record side#2",
        "compute wait side#1",  # only batch 0's copy, not the one behind it
        "record_stream numel=1 on compute",
        "copy",
        "side record side#3",
    ]
    fake_cuda.clear()
    rest = list(it)
    assert len(rest) == 2
    assert fake_cuda == [
        "compute wait side#2",
        "record_stream numel=2 on compute",
        "compute wait side#3",
        "record_stream numel=3 on compute",
    ]


def test_cuda_protocol_orders_copies_after_device_tensors(fake_cuda: list[str]) -> None:
    already = torch.empty(2, device="meta")  # "produced on the compute stream"
    it = iter(prefetch([(already, torch.ones(1))], device="cuda", depth=1))
    x, y = next(it)
    assert x is already
    assert y.device.type == "meta"
    # "copy" marks the start of the one walk; the side stream waits for the compute
    # stream as soon as the walk meets the device tensor, before the copy behind it.
    assert fake_cuda[:3] == ["copy", "side wait_stream compute", "side record side#1"]


class SlottedBatch:
    """A custom batch moved by its own .to(), its tensors in __slots__."""

    __slots__ = ("parent", "x")

    def __init__(self, x: torch.Tensor, parent: Any = None) -> None:
        self.x = x
        self.parent = parent

    def to(self, device: Any, non_blocking: bool = False) -> SlottedBatch:
        moved = SlottedBatch(self.x.to(device, non_blocking=non_blocking))
        moved.parent = moved  # a back-reference must not send the walk in circles
        return moved


class DictBatch:
    """A custom batch moved by its own .to(), with a back-reference to itself."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.me = self

    def to(self, device: Any, non_blocking: bool = False) -> DictBatch:
        return DictBatch(self.x.to(device, non_blocking=non_blocking))


def test_cuda_protocol_records_tensors_inside_custom_batches(fake_cuda: list[str]) -> None:
    source = [{"b": SlottedBatch(torch.zeros(5))}, {"b": DictBatch(torch.zeros(6))}]
    out = list(prefetch(source, device="cuda", depth=1))
    assert out[0]["b"].x.device.type == out[1]["b"].x.device.type == "meta"
    assert "record_stream numel=5 on compute" in fake_cuda
    assert "record_stream numel=6 on compute" in fake_cuda
    assert "side wait_stream compute" not in fake_cuda  # all found: no fallback


class Opaque:
    """A custom batch whose .to() keeps its tensor where a walk cannot see it."""

    __slots__ = ("hidden",)

    def __init__(self, x: torch.Tensor) -> None:
        self.hidden = (lambda: x,)  # a closure: no attribute to walk into

    def to(self, device: Any, non_blocking: bool = False) -> Opaque:
        return Opaque(self.hidden[0]().to(device, non_blocking=non_blocking))


def test_cuda_protocol_orders_copies_after_compute_when_tensors_may_hide(
    fake_cuda: list[str],
) -> None:
    source = [Opaque(torch.zeros(1)), torch.zeros(2), torch.zeros(3)]
    list(prefetch(source, device="cuda", depth=1))
    assert fake_cuda == [
        "copy",
        "side record side#1",
        "compute wait side#1",  # batch 0 cannot be searched for tensors to record,
        "side wait_stream compute",  # so every later copy waits for the compute stream
        "copy",
        "side record side#2",
        "compute wait side#2",
        "record_stream numel=2 on compute",
        "side wait_stream compute",
        "copy",
        "side record side#3",
        "compute wait side#3",
        "record_stream numel=3 on compute",
    ]


def test_cuda_protocol_orders_copies_after_compute_when_record_stream_fails(
    fake_cuda: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def record_stream(self: torch.Tensor, s: Any) -> None:
        raise RuntimeError("record_stream is not supported for this tensor subclass")

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream, raising=False)
    list(prefetch([torch.zeros(1), torch.zeros(2)], device="cuda", depth=1))
    assert fake_cuda == [
        "copy",
        "side record side#1",
        "compute wait side#1",
        "side wait_stream compute",  # batch 0 could not be recorded: copies wait
        "copy",
        "side record side#2",
        "compute wait side#2",
    ]


def test_cuda_protocol_keeps_overlap_when_every_tensor_is_recorded(fake_cuda: list[str]) -> None:
    source = [(torch.zeros(1), [Pair(torch.zeros(2), "a")], {"r": Record(torch.zeros(3))})] * 4
    list(prefetch(source, device="cuda", depth=2))
    assert "side wait_stream compute" not in fake_cuda
    assert sum(e.startswith("record_stream") for e in fake_cuda) == 4 * 3
