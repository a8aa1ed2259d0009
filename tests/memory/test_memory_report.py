"""Tests for cudakit.memory: memory_report / memory_snapshot.

CUDA bookkeeping is proven on CPU with a fake allocator substituted for the
module's ``_cuda`` seam; the CPU fallback runs on real /proc numbers; real GPU
behaviour is in tests marked ``cuda``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cudakit._accel import follows_current_device
from cudakit.device import resolve_device
from cudakit.exceptions import DeviceError
from cudakit.memory import (
    DeviceMemory,
    MemoryMeter,
    MemoryReport,
    MemorySnapshot,
    _frames,
    _probes,
    _targets,
    memory_report,
    memory_snapshot,
)

MiB = 2**20
GiB = 2**30


# --------------------------------------------------------------------------- fakes


class FakeCuda:
    """A caching allocator whose numbers the test controls."""

    def __init__(self, count: int = 1, initialized: bool = True) -> None:
        self.count = count
        self.initialized = initialized
        self.current = 0  # torch.cuda.current_device() of the calling thread
        self.alloc = [0] * count
        self.res = [0] * count
        self.peak_a = [0] * count
        self.peak_r = [0] * count
        self.total = 80 * GiB
        self.calls: list[str] = []
        self.history_error: Exception | None = None
        self.largest: int | None = 3 * MiB

    # test controls
    def malloc(self, n: int, dev: int = 0) -> None:
        self.initialized = True
        self.alloc[dev] += n
        self.peak_a[dev] = max(self.peak_a[dev], self.alloc[dev])
        if self.res[dev] < self.alloc[dev]:
            self.res[dev] = self.alloc[dev]
            self.peak_r[dev] = max(self.peak_r[dev], self.res[dev])

    def free(self, n: int, dev: int = 0) -> None:
        self.alloc[dev] -= n

    # the seam
    def is_available(self) -> bool:
        return self.count > 0

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return self.count

    def current_index(self) -> int:
        return self.current

    def stats(self, i: int) -> tuple[int, int, int, int]:
        if not self.initialized:
            raise AssertionError("stats() read before CUDA started")
        self.calls.append(f"stats{i}")
        return self.alloc[i], self.res[i], self.peak_a[i], self.peak_r[i]

    def reset_peak(self, i: int) -> None:
        if not self.initialized:
            raise AssertionError("reset_peak() would start CUDA")
        self.calls.append(f"reset{i}")
        self.peak_a[i] = self.alloc[i]
        self.peak_r[i] = self.res[i]

    def free_total(self, i: int) -> tuple[int | None, int | None]:
        if not self.initialized:
            raise AssertionError("mem_get_info() would start CUDA")
        return self.total - self.res[i], self.total

    def largest_free_block(self, i: int) -> int | None:
        return self.largest

    def start_history(self, stacks: str = "python") -> None:
        self.initialized = True  # the real seam calls torch.cuda.init() first
        self.calls.append("start_history")

    def dump_history(self, path: str) -> None:
        if self.history_error is not None:
            raise self.history_error
        self.calls.append(f"dump:{os.path.basename(path)}")

    def stop_history(self) -> None:
        self.calls.append("stop_history")


class FakeCpu:
    def __init__(self, resettable: bool = True) -> None:
        self.rss_now = 100 * MiB
        self.hwm = 100 * MiB
        self.resettable = resettable

    def touch(self, n: int) -> None:
        self.rss_now += n
        self.hwm = max(self.hwm, self.rss_now)

    def rss(self) -> int:
        return self.rss_now

    def rss_peak(self) -> tuple[int, int]:
        return self.rss_now, self.hwm

    def reset_peak(self, rss_before: int) -> bool:
        assert rss_before == self.rss_now
        if self.resettable:
            self.hwm = self.rss_now
        return self.resettable

    def free_total(self) -> tuple[int | None, int | None]:
        return 1 * GiB, 2 * GiB


def _fake_resolve(fake: FakeCuda) -> Any:
    def resolve(spec: Any = None) -> torch.device:
        if spec is None or spec in ("auto", "cuda"):
            return torch.device("cuda", 0)
        if isinstance(spec, str) and spec.startswith("cuda:"):
            i = int(spec[5:])
            if i >= fake.count:
                raise DeviceError(f"no cuda:{i}")
            return torch.device("cuda", i)
        return resolve_device(spec)

    return resolve


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    f = FakeCuda()
    monkeypatch.setattr(_probes, "cuda", f)
    monkeypatch.setattr(_targets, "resolve_device", _fake_resolve(f))
    return f


@pytest.fixture
def fake2(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    f = FakeCuda(count=2)
    monkeypatch.setattr(_probes, "cuda", f)
    monkeypatch.setattr(_targets, "resolve_device", _fake_resolve(f))
    return f


@pytest.fixture
def fcpu(monkeypatch: pytest.MonkeyPatch) -> FakeCpu:
    f = FakeCpu()
    monkeypatch.setattr(_probes, "cpu", f)
    return f


@pytest.fixture(autouse=True)
def _no_open_frames() -> Iterator[None]:
    yield
    assert all(not frames for frames in _frames.STACK.open.values()), "a report was left open"
    assert _frames.STACK.history_depth == 0


# --------------------------------------------------------------------------- CUDA logic


def test_cuda_report_numbers(fake: FakeCuda) -> None:
    fake.malloc(100 * MiB)
    with memory_report("step", file=None) as rep:
        fake.malloc(300 * MiB)
        fake.free(250 * MiB)
    assert rep.device == "cuda:0"
    assert rep.allocated_before == 100 * MiB
    assert rep.allocated_after == 150 * MiB
    assert rep.allocated_delta == 50 * MiB
    assert rep.peak_allocated == 400 * MiB
    assert rep.peak_increase == 300 * MiB
    assert rep.reserved_before == 100 * MiB
    assert rep.reserved_after == 400 * MiB
    assert rep.reserved_delta == 300 * MiB
    assert rep.peak_reserved == 400 * MiB
    assert rep.total == 80 * GiB
    assert rep.free == 80 * GiB - 400 * MiB
    assert rep.elapsed >= 0
    assert rep.raised is None
    assert rep.shared is False
    assert rep.devices[0].cuda_started is True


def test_peak_is_reset_at_block_start(fake: FakeCuda) -> None:
    fake.malloc(1 * GiB)
    fake.free(1 * GiB)
    with memory_report(file=None) as rep:
        fake.malloc(10 * MiB)
    assert rep.peak_allocated == 10 * MiB


def test_three_levels_of_nesting(fake: FakeCuda) -> None:
    with memory_report("outer", file=None) as outer:
        fake.malloc(500 * MiB)  # outer-only peak, before any inner reset
        fake.free(500 * MiB)
        with memory_report("middle", file=None) as middle:
            fake.malloc(200 * MiB)
            fake.free(200 * MiB)
            with memory_report("inner", file=None) as inner:
                fake.malloc(50 * MiB)
                fake.free(50 * MiB)
            fake.malloc(300 * MiB)  # after the inner block: middle's peak
            fake.free(300 * MiB)
        fake.malloc(100 * MiB)
    assert inner.peak_allocated == 50 * MiB
    assert middle.peak_allocated == 300 * MiB
    assert outer.peak_allocated == 500 * MiB
    assert outer.allocated_delta == 100 * MiB
    assert outer.peak_reserved == 500 * MiB
    assert inner.peak_reserved == 500 * MiB  # the cache was already that large


def test_nesting_peak_inside_inner_reaches_outer(fake: FakeCuda) -> None:
    with memory_report(file=None) as outer:
        with memory_report(file=None), memory_report(file=None) as inner:
            fake.malloc(700 * MiB)
            fake.free(700 * MiB)
        fake.malloc(1 * MiB)
    assert inner.peak_allocated == 700 * MiB
    assert outer.peak_allocated == 700 * MiB


@st.composite
def _programs(draw: st.DrawFn) -> list[tuple[str, int]]:
    """Random well-nested sequences of open/close/malloc/free."""
    ops: list[tuple[str, int]] = []
    depth = 0
    live = 0
    for _ in range(draw(st.integers(1, 30))):
        choice = draw(st.sampled_from(["open", "close", "malloc", "free"]))
        if choice == "open" and depth < 4:
            ops.append(("open", 0))
            depth += 1
        elif choice == "close" and depth > 0:
            ops.append(("close", 0))
            depth -= 1
        elif choice == "malloc":
            n = draw(st.integers(1, 1000))
            ops.append(("malloc", n))
            live += n
        elif choice == "free" and live > 0:
            n = draw(st.integers(1, live))
            ops.append(("free", n))
            live -= n
    ops.extend([("close", 0)] * depth)
    return ops


@given(_programs())
def test_nested_peaks_match_a_brute_force_model(program: list[tuple[str, int]]) -> None:
    f = FakeCuda()
    saved = _probes.cuda, _targets.resolve_device
    _probes.cuda = f
    _targets.resolve_device = _fake_resolve(f)  # type: ignore[assignment]
    try:
        stack: list[tuple[MemoryMeter, MemoryReport, int]] = []
        history: list[int] = [0]  # allocated after every event
        results: list[tuple[MemoryReport, int]] = []
        for op, n in program:
            if op == "open":
                r = memory_report(file=None)
                stack.append((r, r.__enter__(), len(history) - 1))
            elif op == "close":
                r, rep, start = stack.pop()
                r.__exit__(None, None, None)
                results.append((rep, max(history[start:])))
            elif op == "malloc":
                f.malloc(n)
                history.append(f.alloc[0])
            else:
                f.free(n)
                history.append(f.alloc[0])
        for rep, expected in results:
            assert rep.peak_allocated == expected
    finally:
        _probes.cuda = saved[0]
        _targets.resolve_device = saved[1]


def test_cuda_not_started_is_reported_without_starting_it(fake: FakeCuda) -> None:
    fake.initialized = False
    out = io.StringIO()
    with memory_report("idle", file=out) as rep:
        pass
    assert fake.initialized is False
    assert rep.devices[0].cuda_started is False
    assert rep.peak_allocated == 0
    assert rep.free is None
    assert "CUDA not started" in out.getvalue()
    assert "CUDA not started" in str(rep)
    snap = memory_snapshot()
    assert snap.cuda_started is False
    assert "CUDA not started" in str(snap)


def test_peak_is_never_below_either_end_of_the_block(fake: FakeCuda, fcpu: FakeCpu) -> None:
    # Another thread may free memory between the "before" read and the reset.
    fake.malloc(100 * MiB)
    real_reset = fake.reset_peak

    def reset_after_a_free(i: int) -> None:
        fake.free(60 * MiB)
        fake.res[i] -= 60 * MiB
        real_reset(i)

    fake.reset_peak = reset_after_a_free  # type: ignore[method-assign]
    with memory_report(file=None) as rep:
        pass
    assert rep.allocated_before == 100 * MiB
    assert rep.peak_allocated == 100 * MiB
    assert rep.peak_increase == 0
    assert rep.peak_reserved == 100 * MiB

    def reset_below(rss_before: int) -> bool:
        fcpu.hwm = 50 * MiB  # RSS dropped between the read and the reset
        return True

    fcpu.reset_peak = reset_below  # type: ignore[method-assign]
    with memory_report(device="cpu", file=None) as cpu_rep:
        pass
    assert cpu_rep.peak_allocated == cpu_rep.allocated_before == 100 * MiB


def test_block_that_starts_cuda_reports_it(fake: FakeCuda) -> None:
    fake.initialized = False
    with memory_report(file=None) as rep:
        fake.malloc(64 * MiB)  # first CUDA allocation starts CUDA
        fake.free(32 * MiB)
    assert rep.devices[0].cuda_started is True
    assert rep.allocated_before == 0
    assert rep.allocated_after == 32 * MiB
    assert rep.peak_allocated == 64 * MiB


def test_device_all_reports_every_cuda_device(fake2: FakeCuda) -> None:
    with memory_report(device="all", file=None) as rep:
        fake2.malloc(10 * MiB, 0)
        fake2.malloc(30 * MiB, 1)
    assert [d.device for d in rep.devices] == ["cuda:0", "cuda:1"]
    assert rep.devices[1].peak_allocated == 30 * MiB
    assert rep.peak_allocated == 40 * MiB  # sums over devices
    assert rep.device == "cuda:0, cuda:1"
    assert rep.line().count("cuda:") == 2
    snaps = memory_snapshot("all")
    assert [s.allocated for s in snaps] == [10 * MiB, 30 * MiB]


def test_device_index_selects_that_device(fake2: FakeCuda) -> None:
    with memory_report(device="cuda:1", file=None) as rep:
        fake2.malloc(5 * MiB, 1)
        fake2.malloc(7 * MiB, 0)
    assert rep.device == "cuda:1"
    assert rep.peak_allocated == 5 * MiB


def test_default_device_follows_the_current_device_at_each_call(fake2: FakeCuda) -> None:
    # A decorator (or a reused reporter) made before torch.cuda.set_device(local_rank)
    # must measure the device current when it runs, not the one current at decoration.
    @memory_report(file=None)
    def step() -> None:
        fake2.malloc(5 * MiB, fake2.current)

    reused = memory_report(file=None)
    pinned = memory_report(device="cuda:0", file=None)
    fake2.current = 1
    step()
    last = step.memory_report.last
    assert last is not None
    assert (last.device, last.peak_allocated) == ("cuda:1", 5 * MiB)
    with reused as rep, pinned as rep0:
        fake2.malloc(7 * MiB, 1)
    assert (rep.device, rep.peak_increase) == ("cuda:1", 7 * MiB)
    assert (rep0.device, rep0.peak_increase) == ("cuda:0", 0)


@pytest.mark.parametrize(
    ("device", "follows"),
    [
        (None, True),
        ("auto", True),
        ("cuda", True),
        (torch.device("cuda"), True),
        ("cuda:0", False),
        (0, False),
        (torch.device("cuda", 1), False),
        ("cpu", False),
        ("all", False),
    ],
)
def test_which_device_specs_follow_the_current_device(device: Any, follows: bool) -> None:
    assert follows_current_device(device) is follows


def test_device_all_without_cuda_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_probes, "cuda", FakeCuda(count=0))
    with pytest.raises(DeviceError, match=r"device='all'.*CUDA is not available.*device=None"):
        memory_report(device="all")
    with pytest.raises(DeviceError, match=r"memory_snapshot\(device='all'\)"):
        memory_snapshot("all")


def test_unsupported_device_is_a_clear_error() -> None:
    with pytest.raises(DeviceError, match=r"measures CUDA devices and the CPU.*meta.*'cpu'"):
        memory_report(device="meta")
    with pytest.raises(DeviceError, match="did you mean"):
        memory_report(device="gpu0")


# --------------------------------------------------------------------------- exceptions


def _run_in(reporter: MemoryMeter, body: Callable[[], object], reps: list[MemoryReport]) -> None:
    """Run ``body`` inside ``reporter``, keeping the yielded report even if ``body`` raises."""
    with reporter as rep:
        reps.append(rep)
        body()


def test_exception_still_reports_and_propagates_unchanged(fake: FakeCuda) -> None:
    err = KeyError("boom")
    out = io.StringIO()
    reps: list[MemoryReport] = []

    def body() -> None:
        fake.malloc(MiB)
        raise err

    with pytest.raises(KeyError, match="boom") as info:
        _run_in(memory_report("bad", file=out), body, reps)
    rep = reps[0]
    assert info.value is err
    assert rep.raised == "KeyError"
    assert "[raised KeyError]" in out.getvalue()
    assert rep.peak_allocated == MiB
    assert not getattr(err, "__notes__", None)


def test_oom_gets_an_actionable_note(fake: FakeCuda) -> None:
    fake.malloc(2 * GiB)
    fake.free(1 * GiB)
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    def body() -> None:
        with memory_report("train", file=None):
            fake.malloc(512 * MiB)
            raise err

    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate") as info:
        _run_in(memory_report("outer", file=None), body, [])
    assert info.value is err
    assert type(info.value) is torch.OutOfMemoryError
    notes = info.value.__notes__
    assert len(notes) == 1  # the outer report does not repeat it
    note = notes[0]
    assert "'train' on cuda:0" in note
    assert "peak allocated 1.50 GiB" in note
    assert "reserved 2.00 GiB (512.00 MiB cached but unused)" in note
    assert "largest free cached block 3.00 MiB" in note
    assert "expandable_segments" in note
    assert "memory_viz" in note


def test_cpu_memory_error_gets_a_note(fcpu: FakeCpu) -> None:
    def body() -> None:
        fcpu.touch(300 * MiB)
        raise MemoryError

    with pytest.raises(MemoryError) as info:
        _run_in(memory_report(device="cpu", file=None), body, [])
    assert "peak RSS 400.00 MiB" in info.value.__notes__[0]


def test_real_cpu_allocator_failure_gets_a_note() -> None:
    # torch raises a RuntimeError (not MemoryError) when the CPU allocator fails.
    with (
        pytest.raises(RuntimeError, match="DefaultCPUAllocator") as info,
        memory_report("huge", device="cpu", file=None),
    ):
        torch.empty(2**50, dtype=torch.uint8)
    assert any("memory_report 'huge' on cpu: peak RSS" in n for n in info.value.__notes__)


def test_oom_note_once_per_device_across_nested_reports(fake: FakeCuda) -> None:
    err = torch.OutOfMemoryError("CUDA out of memory")
    with (
        pytest.raises(torch.OutOfMemoryError) as info,
        memory_report("gpu", file=None),
        memory_report("host", device="cpu", file=None),
    ):
        raise err
    notes = info.value.__notes__
    assert len(notes) == 2
    assert "'host' on cpu" in notes[0]
    assert "'gpu' on cuda:0" in notes[1]


def test_other_errors_get_no_memory_note(fake: FakeCuda) -> None:
    with pytest.raises(RuntimeError, match="shapes") as info, memory_report(file=None):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert not getattr(info.value, "__notes__", None)


def test_failure_while_opening_leaves_nothing_open(fake2: FakeCuda) -> None:
    real_stats = fake2.stats

    def stats(i: int) -> tuple[int, int, int, int]:
        if i == 1:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return real_stats(i)

    fake2.stats = stats  # type: ignore[method-assign]
    r = memory_report(device="all", file=None, record_history="h.pickle")
    with pytest.raises(RuntimeError, match="unspecified launch failure"):
        r.__enter__()
    assert not _frames.STACK.open.get("cuda:0")  # the frame opened for cuda:0 was rolled back
    assert fake2.calls[-1] == "stop_history"
    fake2.stats = real_stats  # type: ignore[method-assign]
    with r as rep:  # the object is usable again
        fake2.malloc(MiB, 1)
    assert rep.devices[1].peak_allocated == MiB


def test_failure_while_closing_does_not_replace_the_blocks_error(fake: FakeCuda) -> None:
    # After a device-side assert every CUDA call fails; the user's error must go on unchanged.
    err = IndexError("target 12 is out of bounds")
    r = memory_report("step", file=None)
    reps: list[MemoryReport] = []

    def body() -> None:
        fake.free_total = _raise_cuda_error  # type: ignore[method-assign]
        raise err

    with pytest.raises(IndexError) as info:
        _run_in(r, body, reps)
    assert info.value is err
    assert (
        "'step' has no numbers: reading the memory counters failed with RuntimeError: CUDA "
        in (info.value.__notes__[0])
    )
    with pytest.raises(RuntimeError, match=r"'step' has no numbers.*device-side assert"):
        _ = reps[0].peak_allocated
    assert "no numbers" in str(reps[0])
    # without an error in the block, the failure itself is raised
    with pytest.raises(RuntimeError, match=r"'step' has no numbers.*device-side") as info2, r:
        pass
    assert isinstance(info2.value.__cause__, RuntimeError)


def _raise_cuda_error(i: int) -> tuple[int, int]:
    raise RuntimeError("CUDA error: device-side assert triggered")


# --------------------------------------------------------------------------- CPU fallback


def test_cpu_real_200mb_block_reports_its_peak() -> None:
    with memory_report("big", device="cpu", file=None) as rep:
        x = torch.ones(50 * 2**20)  # 200 MiB, every page touched
        del x
    assert rep.device == "cpu"
    assert rep.peak_increase >= 200 * 2**20 * 0.98, str(rep)
    assert rep.peak_allocated >= rep.allocated_before + 190 * MiB
    assert rep.reserved_before is None
    assert rep.peak_reserved is None
    assert rep.total is not None
    assert rep.free is not None
    assert 0 < rep.free <= rep.total
    assert "RSS" in rep.line()
    assert "available" in rep.line()


def test_cpu_real_three_levels_of_nesting() -> None:
    with memory_report(device="cpu", file=None) as outer:
        a = torch.ones(40 * 2**20)  # 160 MiB before any inner reset
        del a
        with memory_report(device="cpu", file=None) as middle:
            with memory_report(device="cpu", file=None) as inner:
                b = torch.ones(5 * 2**20)  # 20 MiB
                del b
            c = torch.ones(20 * 2**20)  # 80 MiB after the inner block
            del c
    if outer.devices[0].peak_since_start:
        pytest.skip("this kernel cannot reset the peak RSS")
    assert outer.peak_increase >= 150 * MiB
    assert middle.peak_increase >= 75 * MiB
    assert middle.peak_increase < 150 * MiB
    assert inner.peak_increase < 75 * MiB
    assert outer.peak_allocated >= middle.peak_allocated >= inner.peak_allocated


def test_cpu_nesting_with_fake_proc(fcpu: FakeCpu) -> None:
    with memory_report(device="cpu", file=None) as outer:
        fcpu.touch(50 * MiB)
        fcpu.touch(-50 * MiB)
        with memory_report(device="cpu", file=None) as middle:
            with memory_report(device="cpu", file=None) as inner:
                fcpu.touch(10 * MiB)
                fcpu.touch(-10 * MiB)
            fcpu.touch(20 * MiB)
    assert inner.peak_increase == 10 * MiB
    assert middle.peak_increase == 20 * MiB
    assert outer.peak_increase == 50 * MiB
    assert outer.allocated_delta == 20 * MiB
    assert outer.free == GiB
    assert outer.total == 2 * GiB


def test_cpu_peak_since_start_when_it_cannot_be_reset(fcpu: FakeCpu) -> None:
    fcpu.resettable = False
    fcpu.hwm = 900 * MiB
    with memory_report(device="cpu", file=None) as rep:
        fcpu.touch(MiB)
    assert rep.devices[0].peak_since_start is True
    assert rep.peak_allocated == 900 * MiB
    assert "peak RSS since process start" in rep.line()
    assert "since process start" in str(rep)


def test_real_proc_backend_reads_and_resets() -> None:
    cpu = _probes.ProcCpu()
    rss, peak = cpu.rss_peak()
    assert 0 < rss <= peak
    assert abs(cpu.rss() - rss) < 64 * MiB
    free, total = cpu.free_total()
    assert total is not None
    assert free is not None
    assert 0 < free <= total
    assert cpu.reset_peak(cpu.rss()) in (True, False)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux /proc")
@pytest.mark.filterwarnings("ignore:.*fork\\(\\) may lead to deadlocks:DeprecationWarning")
def test_proc_backend_reads_the_child_after_a_fork() -> None:
    # Descriptors opened on /proc/self name the parent; a forked child must reopen them.
    cpu = _probes.cpu
    cpu.rss()  # open them in the parent
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no torch ops, exit code is the verdict
        code = 1
        try:
            before = cpu.rss()
            blob = b"x" * (64 * MiB)  # every page written
            code = 0 if cpu.rss() - before >= 48 * MiB and len(blob) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_cpu_peak_ignores_a_stale_thread_exit_high_water_mark() -> None:
    # A thread that exits may make the kernel save the high-water mark into the
    # getrusage peak, which clear_refs cannot reset; the report must not show it.
    def work() -> None:
        x = torch.ones(40 * 2**20)  # 160 MiB
        del x

    t = threading.Thread(target=work)
    t.start()
    t.join(30)
    with memory_report(device="cpu", file=None) as rep:
        pass
    if rep.devices[0].peak_since_start:
        pytest.skip("this kernel cannot reset the peak RSS")
    assert rep.peak_increase < 100 * MiB, str(rep)


def test_stale_getrusage_floor_falls_back_to_vmhwm(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = _probes.ProcCpu()
    if not cpu.reset_peak(cpu.rss()):
        pytest.skip("this kernel cannot reset the peak RSS")
    monkeypatch.setattr(_probes.ProcCpu, "_maxrss", staticmethod(lambda: 1 << 50))
    assert cpu.reset_peak(cpu.rss()) is True
    assert cpu._ru_exact is False
    assert cpu.peak() < 1 << 50  # read from /proc/self/status instead


# --------------------------------------------------------------------------- output


def test_default_output_is_one_line_on_stderr(
    fcpu: FakeCpu, capsys: pytest.CaptureFixture[str]
) -> None:
    with memory_report("blk", device="cpu"):
        fcpu.touch(MiB)
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("memory_report 'blk' cpu: peak 101.00 MiB (+1.00 MiB)")
    assert "RSS 100.00 MiB → 101.00 MiB (+1.00 MiB)" in err


def test_cuda_line_and_table(fake: FakeCuda) -> None:
    out = io.StringIO()
    with memory_report("t", file=out) as rep:
        fake.malloc(3 * GiB)
    line = out.getvalue()
    assert "cuda:0: peak 3.00 GiB (+3.00 GiB)" in line
    assert "reserved 0 B → 3.00 GiB (+3.00 GiB, peak 3.00 GiB)" in line
    assert "free 77.00 GiB of 80.00 GiB" in line
    table = str(rep)
    assert "before" in table
    assert "peak" in table
    assert "allocated" in table
    assert "reserved" in table
    assert table.count("3.00 GiB") >= 4


def test_file_none_is_silent(fcpu: FakeCpu, capsys: pytest.CaptureFixture[str]) -> None:
    with memory_report(device="cpu", file=None) as rep:
        pass
    assert capsys.readouterr() == ("", "")
    assert rep.done


def test_log_to_logger_and_callable(
    fcpu: FakeCpu, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = logging.getLogger("cudakit.test.memory")
    with (
        caplog.at_level(logging.INFO, logger="cudakit.test.memory"),
        memory_report("lg", device="cpu", log=logger),
    ):
        pass
    assert any("memory_report 'lg' cpu" in r.getMessage() for r in caplog.records)
    lines: list[str] = []
    with memory_report("cb", device="cpu", log=lines.append):
        pass
    assert len(lines) == 1
    assert lines[0].startswith("memory_report 'cb'")
    assert capsys.readouterr().err == ""  # log= replaces the default stderr line
    out = io.StringIO()
    with memory_report("both", device="cpu", log=lines.append, file=out):
        pass
    assert out.getvalue().strip() == lines[-1]


def test_json_round_trip(fake2: FakeCuda) -> None:
    reps: list[MemoryReport] = []

    def body() -> None:
        fake2.malloc(123, 1)
        raise ValueError("bad value")

    with pytest.raises(ValueError, match="bad value"):
        _run_in(memory_report("rt", device="all", file=None), body, reps)
    rep = reps[0]
    data = json.loads(rep.to_json())
    assert data["label"] == "rt"
    assert data["raised"] == "ValueError"
    assert data["devices"][1]["peak_allocated"] == 123
    back = MemoryReport.from_json(rep.to_json())
    assert back == rep
    assert back.peak_allocated == 123
    assert str(back) == str(rep)


def test_json_round_trip_cpu() -> None:
    with memory_report(device="cpu", file=None) as rep:
        pass
    assert MemoryReport.from_dict(json.loads(rep.to_json(indent=2))) == rep


def test_reading_an_open_report_is_a_clear_error(fcpu: FakeCpu) -> None:
    with memory_report("open", device="cpu", file=None) as rep:
        with pytest.raises(RuntimeError, match=r"'open' is still open.*after the block"):
            _ = rep.peak_allocated
        assert "still open" in str(rep)


# --------------------------------------------------------------------------- decorator


def test_bare_decorator_uses_function_name(
    fcpu: FakeCpu, capsys: pytest.CaptureFixture[str]
) -> None:
    @memory_report
    def evaluate(x: int, *, scale: int = 2) -> int:
        """Doc."""
        fcpu.touch(MiB)
        return x * scale

    assert evaluate(3, scale=3) == 9
    assert evaluate.__name__ == "evaluate"
    assert evaluate.__doc__ == "Doc."
    assert isinstance(evaluate.memory_report, MemoryMeter)
    last = evaluate.memory_report.last
    assert last is not None
    assert last.label == "evaluate"
    assert last.peak_increase == MiB
    assert "evaluate" in capsys.readouterr().err


def test_decorator_with_arguments_and_every(fcpu: FakeCpu) -> None:
    out = io.StringIO()

    @memory_report("eval", device="cpu", file=out, every=3)
    def evaluate() -> None:
        fcpu.touch(MiB)

    for _ in range(7):
        evaluate()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert all(line.startswith("memory_report 'eval' cpu x3 calls: peak max") for line in lines)
    assert evaluate.memory_report.calls == 7
    evaluate.memory_report.flush()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert "x3 calls" not in lines[2]
    evaluate.memory_report.flush()
    assert len(out.getvalue().splitlines()) == 3  # nothing pending


def test_default_throttle_first_call_then_time_based(
    fcpu: FakeCpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(_probes, "monotonic", lambda: now[0])
    out = io.StringIO()

    @memory_report(device="cpu", file=out)
    def step() -> None:
        pass

    for _ in range(150):
        step()
        now[0] += 0.1  # 10 calls per simulated second, 15 s in all
    lines = out.getvalue().splitlines()
    # first call at once; then one aggregate when 10 s have passed
    assert len(lines) == 2, lines
    assert "x" not in lines[0].split("cpu")[1][:3]
    assert "'step' cpu x100 calls: peak max" in lines[1]
    step.memory_report.flush()
    assert len(out.getvalue().splitlines()) == 3


def test_rare_calls_each_report_under_default_throttle(
    fcpu: FakeCpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    monkeypatch.setattr(_probes, "monotonic", lambda: now[0])
    out = io.StringIO()
    rep = memory_report("epoch", device="cpu", file=out)
    for _ in range(3):
        with rep:  # one object reused in a loop
            pass
        now[0] += 60.0
    assert len(out.getvalue().splitlines()) == 3


def test_failures_are_always_written(fcpu: FakeCpu) -> None:
    out = io.StringIO()

    @memory_report(device="cpu", file=out, every=100)
    def f(fail: bool) -> None:
        if fail:
            raise RuntimeError("x")

    f(False)
    with pytest.raises(RuntimeError, match="x"):
        f(True)
    assert out.getvalue().count("[raised RuntimeError]") == 1


def test_decorated_recursion_gets_nested_reports(fcpu: FakeCpu) -> None:
    @memory_report(device="cpu", file=None)
    def fact(n: int) -> int:
        fcpu.touch(MiB)
        return 1 if n <= 1 else n * fact(n - 1)

    assert fact(4) == 24
    assert fact.memory_report.calls == 4
    last = fact.memory_report.last
    assert last is not None
    assert last.peak_increase == 4 * MiB


def test_decorating_a_generator_is_refused() -> None:
    with pytest.raises(TypeError, match="generator or coroutine"):

        @memory_report(device="cpu")
        def gen() -> Iterator[int]:
            yield 1


def test_exit_without_enter_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"without __enter__; use `with memory_report\(\):`"):
        memory_report(device="cpu").__exit__(None, None, None)


def test_forked_child_can_close_a_report_opened_before_the_fork(fcpu: FakeCpu) -> None:
    r = memory_report(device="cpu", file=None)
    rep = r.__enter__()
    _frames.STACK.reset()  # what the child sees: no open reports
    r.__exit__(None, None, None)
    assert rep.done


def test_reentering_an_open_reporter_is_a_clear_error(fcpu: FakeCpu) -> None:
    r = memory_report("x", device="cpu", file=None)
    with r, pytest.raises(RuntimeError, match=r"already open.*new\s+`with memory_report"):
        r.__enter__()


# --------------------------------------------------------------------------- threads


def test_overlapping_threads_are_marked_shared(fake: FakeCuda) -> None:
    inside = threading.Event()
    release = threading.Event()
    reports: dict[str, MemoryReport] = {}

    def worker() -> None:
        with memory_report("worker", file=None) as rep:
            inside.set()
            release.wait(10)
        reports["worker"] = rep

    t = threading.Thread(target=worker)
    t.start()
    assert inside.wait(10)
    out = io.StringIO()
    with memory_report("main", file=out) as main:
        fake.malloc(MiB)
    release.set()
    t.join(10)
    assert main.shared is True
    assert reports["worker"].shared is True
    assert "[shared" in out.getvalue()
    assert "SHARED" in str(main)
    with memory_report("alone", file=None) as alone:
        pass
    assert alone.shared is False


def test_threads_on_same_device_keep_peaks_consistent(fake: FakeCuda) -> None:
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        try:
            barrier.wait(10)
            for _ in range(50):
                with memory_report(file=None) as rep, lock:
                    fake.malloc(MiB)
                    fake.free(MiB)
                assert rep.peak_allocated >= rep.allocated_before
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert not _frames.STACK.open.get("cuda:0")


# --------------------------------------------------------------------------- record_history


def test_record_history_nested_with_fake(fake: FakeCuda, tmp_path: Any) -> None:
    with (
        memory_report(file=None, record_history=tmp_path / "outer.pickle") as outer,
        memory_report(file=None, record_history=str(tmp_path / "inner.pickle")),
    ):
        pass
    history = [c for c in fake.calls if "history" in c or c.startswith("dump")]
    assert history == ["start_history", "dump:inner.pickle", "dump:outer.pickle", "stop_history"]
    assert outer.history == str(tmp_path / "outer.pickle")
    assert "memory_viz" in str(outer)


def test_record_history_starts_cuda_because_it_was_asked_for(fake: FakeCuda) -> None:
    fake.initialized = False
    with memory_report(file=None, record_history="s.pickle") as rep:
        fake.malloc(MiB)
    assert rep.devices[0].cuda_started is True
    assert rep.peak_allocated == MiB
    assert fake.calls[0] == "start_history"


def test_record_history_written_on_oom(fake: FakeCuda, tmp_path: Any) -> None:
    def body() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        _run_in(memory_report(file=None, record_history=tmp_path / "oom.pickle"), body, [])
    assert "dump:oom.pickle" in fake.calls
    assert fake.calls[-1] == "stop_history"


def test_record_history_write_failure_is_a_clear_error(fake: FakeCuda) -> None:
    fake.history_error = FileNotFoundError("no such directory")
    with (
        pytest.raises(RuntimeError, match=r"could not write the allocator history.*writable"),
        memory_report(file=None, record_history="/nope/x.pickle"),
    ):
        pass
    assert fake.calls[-1] == "stop_history"


def test_record_history_write_failure_after_an_error_is_a_note(fake: FakeCuda) -> None:
    fake.history_error = PermissionError("read-only file system")
    err = ValueError("bad batch")
    with (
        pytest.raises(ValueError, match="bad batch") as info,
        memory_report(file=None, record_history="/ro/x.pickle"),
    ):
        raise err
    assert info.value is err
    assert "could not write the allocator history to '/ro/x.pickle'" in info.value.__notes__[0]
    assert fake.calls[-1] == "stop_history"


def test_record_history_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"records the CUDA caching allocator.*device='cuda'"):
        memory_report(device="cpu", record_history="x.pickle")


# --------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"label": 3},
            TypeError,
            r"label=\.\.\.\) expects a string.*got int 3.*memory_report\('train_step'",
        ),
        ({"file": "out.txt"}, TypeError, r"file=\.\.\.\) expects a text stream.*got str.*log="),
        ({"log": 5}, TypeError, r"log=\.\.\.\) expects a logging.Logger.*got int 5"),
        ({"every": 2.5}, TypeError, r"every=\.\.\.\) expects an int >= 1, got float 2.5"),
        ({"every": True}, TypeError, r"every=\.\.\.\) expects an int >= 1, got bool"),
        ({"every": 0}, ValueError, r"every=\.\.\.\) expects an int >= 1, got int 0\..*file=None"),
        ({"record_history": 1}, TypeError, r"record_history=\.\.\.\) expects a file path.*got int"),
        ({"device": 1.5}, TypeError, r"device must be a torch.device"),
    ],
)
def test_argument_errors(kwargs: dict[str, Any], exc: type[Exception], match: str) -> None:
    label = kwargs.pop("label", None)
    with pytest.raises(exc, match=match):
        memory_report(label, device=kwargs.pop("device", "cpu"), **kwargs)


def test_a_failed_report_changes_nothing(fake: FakeCuda) -> None:
    fake.malloc(MiB)
    with pytest.raises(TypeError):
        memory_report(file=42)  # type: ignore[call-overload]
    assert fake.calls == []
    assert fake.alloc[0] == MiB


# --------------------------------------------------------------------------- memory_snapshot


def test_snapshot_cpu_real() -> None:
    snap = memory_snapshot("cpu")
    assert isinstance(snap, MemorySnapshot)
    assert snap.allocated > 0
    assert snap.peak_allocated >= snap.allocated
    assert snap.to_dict()["device"] == "cpu"
    assert str(snap).startswith("cpu: RSS ")


def test_snapshot_does_not_reset_and_sees_open_report_peak(fake: FakeCuda) -> None:
    with memory_report(file=None):
        fake.malloc(300 * MiB)
        fake.free(300 * MiB)
        with memory_report(file=None):
            snap = memory_snapshot()
            assert snap.peak_allocated == 300 * MiB  # not lost by the inner reset
            assert snap.allocated == 0
            assert snap.reserved == 300 * MiB
    assert "reset0" not in fake.calls[fake.calls.index("stats0") :][-1:]
    before = list(fake.calls)
    memory_snapshot()
    assert not any(c.startswith("reset") for c in fake.calls[len(before) :])
    assert "allocated 0 B (peak" in str(memory_snapshot())


def test_device_memory_properties() -> None:
    d = DeviceMemory("cpu", 10, 4, 30)
    assert (d.allocated_delta, d.reserved_delta, d.peak_increase) == (-6, None, 20)


# --------------------------------------------------------------------------- real CUDA


@pytest.mark.cuda
def test_cuda_real_nested_reports() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=dev)  # start CUDA
    with memory_report("outer", device=dev, file=None) as outer:
        a = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
        del a
        with memory_report("middle", device=dev, file=None) as middle:
            with memory_report("inner", device=dev, file=None) as inner:
                b = torch.empty(32 * MiB, dtype=torch.uint8, device=dev)
                del b
            c = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
    assert inner.peak_increase >= 32 * MiB
    assert 64 * MiB <= middle.peak_increase < 256 * MiB
    assert outer.peak_increase >= 256 * MiB
    assert outer.allocated_delta >= 64 * MiB
    total = torch.cuda.get_device_properties(dev).total_memory
    assert outer.total is not None
    assert abs(outer.total - total) <= total // 100
    assert outer.free is not None
    assert outer.peak_reserved is not None
    del c


@pytest.mark.cuda
def test_cuda_real_oom_note() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    with pytest.raises(torch.OutOfMemoryError) as info, memory_report(device=dev, file=None):
        torch.empty(total * 4, dtype=torch.uint8, device=dev)
    assert any("cudakit.memory_report" in n for n in info.value.__notes__)


@pytest.mark.cuda
def test_cuda_real_record_history(tmp_path: Any) -> None:
    path = tmp_path / "snap.pickle"
    dev = torch.device("cuda", torch.cuda.current_device())
    with memory_report(device=dev, file=None, record_history=path) as rep:
        x = torch.empty(8 * MiB, dtype=torch.uint8, device=dev)
        del x
    assert path.stat().st_size > 0
    assert rep.history == str(path)


@pytest.mark.cuda
def test_cuda_real_report_never_starts_cuda() -> None:
    code = (
        "import torch\n"
        "from cudakit.memory import memory_report, memory_snapshot\n"
        "with memory_report(device='cuda', file=None) as rep: pass\n"
        "memory_snapshot('all')\n"
        "print(torch.cuda.is_initialized(), rep.devices[0].cuda_started)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=root,
        env=env,
    )
    assert out.stdout.split() == ["False", "False"]


def test_label_by_keyword_as_in_the_issue() -> None:
    """``@memory_report(label="eval")`` and ``with memory_report(label=...)`` both work."""

    @memory_report(label="eval", device="cpu", file=None)
    def evaluate() -> int:
        return 3

    assert evaluate() == 3
    with memory_report(label="block", device="cpu", file=None) as rep:
        pass
    assert rep.label == "block"
