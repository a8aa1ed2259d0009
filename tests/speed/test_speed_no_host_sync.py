"""The meter reads nothing from the device per step: events and tensor counts wait for a read."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch.overrides import TorchFunctionMode

import cudakit.speed._recorder as recorder_mod
from cudakit.amp import autocast_step
from cudakit.speed import speed_report
from cudakit.speed._clock import EventClock
from cudakit.speed._tally import BATCH


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values on the host: item, bool, tolist (as tests/amp do)."""

    NAMES = ("item", "__bool__", "tolist")

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _sync_free_step(every: int | None, **counts: Any) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = autocast_step(opt, model=model, dtype=torch.float32, accumulate=2)
    assert step.sync_free

    @speed_report(flops=1e6, every=every, file=None, **counts)
    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    return train


@pytest.mark.parametrize("every", [None, 5])
def test_no_host_reads_in_twenty_metered_steps(skip_on_device: None, every: int | None) -> None:
    train = _sync_free_step(every, samples=len, tokens=lambda x: x.shape[0] * 3)
    x = torch.randn(4, 8)
    with HostReads() as reads:
        for _ in range(20):
            train(x)
    assert reads.calls == []
    meter = train.speed_report
    assert (meter.steps, meter.calls) == (10, 20)
    assert (every is None) == (meter.last_line is None)


def test_tensor_counts_are_read_only_at_the_log_interval(skip_on_device: None) -> None:
    train = _sync_free_step(5, tokens=lambda x: (x[:, 0] > -10).sum())
    x = torch.randn(4, 8)
    with HostReads() as reads:
        for _ in range(20):
            train(x)
    assert reads.calls == ["tolist"] * 2  # steps 5 and 10: one read of all pending counts
    assert train.speed_report.total.tokens == 80.0


class FakeEvent:
    """torch.cuda.Event on the CPU: records a tick; logs waits and reads."""

    log: ClassVar[list[str]] = []
    ticks: ClassVar[Iterator[int]] = itertools.count()
    ready: ClassVar[bool] = True

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t = 0
        FakeEvent.log.append("new")

    def record(self, stream: FakeStream | None = None) -> None:
        assert isinstance(stream, FakeStream)  # the clock always names the stream
        self.t = next(FakeEvent.ticks)
        FakeStream.recorded.append(stream.key)

    def query(self) -> bool:
        FakeEvent.log.append("query")
        return FakeEvent.ready

    def synchronize(self) -> None:
        FakeEvent.log.append("synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        FakeEvent.log.append("elapsed_time")
        return float(end.t - self.t)  # one millisecond per tick


class FakeStream:
    """torch.cuda.Stream on the CPU: counts how many are built, and where events go."""

    current: ClassVar[tuple[int, int, int]] = (0, 0, 1)  # (stream id, device, type)
    built: ClassVar[list[tuple[int, int, int]]] = []
    recorded: ClassVar[list[tuple[int, int, int]]] = []

    def __init__(self, stream_id: int, device_index: int, device_type: int) -> None:
        self.key = (stream_id, device_index, device_type)
        FakeStream.built.append(self.key)


@pytest.fixture
def fake_events(monkeypatch: pytest.MonkeyPatch) -> type[FakeEvent]:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(
        torch._C, "_cuda_getCurrentStream", lambda i: FakeStream.current, raising=False
    )
    monkeypatch.setattr(recorder_mod, "clock_for", lambda device: EventClock())
    FakeStream.current, FakeStream.built, FakeStream.recorded = (0, 0, 1), [], []
    FakeEvent.log = []
    FakeEvent.ticks = itertools.count()
    FakeEvent.ready = True
    return FakeEvent


def test_events_are_read_lazily_and_reused(fake_events: type[FakeEvent]) -> None:
    meter = speed_report(samples=2, every=None, file=None)
    for _ in range(10):
        with meter:
            pass
    assert fake_events.log == ["new"] * 20  # recorded, never waited on or read
    total = meter.total
    assert total.seconds == pytest.approx(10 * 1e-3)  # each call: one tick between its events
    assert fake_events.log.count("query") == 10  # each end event: passed, so no wait
    assert fake_events.log.count("synchronize") == 0
    assert fake_events.log.count("elapsed_time") == 10
    fake_events.log = []
    with meter:
        pass
    assert "new" not in fake_events.log  # the read events are reused


def test_events_go_on_the_current_stream_built_once(fake_events: type[FakeEvent]) -> None:
    """The clock builds a Stream once per current stream, not once per event."""
    meter = speed_report(samples=2, every=None, file=None)
    for _ in range(5):
        with meter:
            pass
    assert FakeStream.built == [(0, 0, 1)]
    assert FakeStream.recorded == [(0, 0, 1)] * 10
    FakeStream.current = (7, 0, 1)  # a `with torch.cuda.stream(s):` block
    with meter:
        pass
    FakeStream.current = (0, 0, 1)
    with meter:
        pass
    assert FakeStream.built == [(0, 0, 1), (7, 0, 1), (0, 0, 1)]
    assert FakeStream.recorded[10:] == [(7, 0, 1)] * 2 + [(0, 0, 1)] * 2
    assert meter.total.seconds == pytest.approx(7 * 1e-3)


def test_the_clock_falls_back_to_current_stream(
    fake_events: type[FakeEvent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch without the stream lookups: torch.cuda.current_stream() per event."""
    monkeypatch.delattr(torch._C, "_cuda_getCurrentStream")
    asked: list[int] = []

    def current_stream() -> FakeStream:
        asked.append(1)
        return FakeStream(3, 0, 1)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    meter = speed_report(samples=2, every=None, file=None)
    with meter:
        pass
    assert len(asked) == 2
    assert FakeStream.recorded == [(3, 0, 1)] * 2


def test_events_read_at_the_log_interval_only(fake_events: type[FakeEvent]) -> None:
    lines: list[str] = []
    meter = speed_report(every=4, log=lines.append)
    fake_events.ready = False  # the device is behind: a read waits for the events
    for i in range(8):
        with meter:
            pass
        waits = fake_events.log.count("synchronize")
        assert waits == (4 if i >= 3 else 0) + (4 if i >= 7 else 0)
    assert len(lines) == 2
    assert "step 8:" in lines[1]


def test_unread_records_stay_bounded(
    fake_events: type[FakeEvent], monkeypatch: pytest.MonkeyPatch
) -> None:
    meter = speed_report(tokens=lambda b: b.sum(), samples=1, every=None, window=3, file=None)
    tally = meter._recorder.tally
    ones = torch.ones(2, dtype=torch.int64)
    with HostReads() as reads:
        fake_events.ready = False  # the device is behind: nothing can be folded yet
        for _ in range(10):
            with meter.measure(ones):
                pass
        assert len(tally._queue) == 10  # queued calls join their steps in batches
        tally._drain()
        assert len(tally._kept) == 20  # an event pair and a tensor count per call
        fake_events.ready = True
        for _ in range(290):
            with meter.measure(ones):
                pass
            assert len(tally._kept) <= tally._fold_at + 2
            assert len(tally._queue) < BATCH
    assert reads.calls == []  # folded counts were summed on the device, not read
    assert "synchronize" not in fake_events.log  # folded once their events had passed
    assert "query" in fake_events.log
    total = meter.total
    assert (total.steps, total.calls, total.samples, total.tokens) == (300, 300, 300.0, 600.0)
    assert total.seconds == pytest.approx(0.3)
    recent = meter.recent
    assert (recent.steps, recent.tokens) == (3, 6.0)


def test_negative_tensor_count_is_refused_when_read() -> None:
    meter = speed_report(tokens=lambda b: b, file=None)
    with meter.measure(torch.tensor(-3)):
        pass
    with pytest.raises(ValueError, match=r"speed_report\(tokens=...\) gave -3.0 for a call"):
        meter.total  # noqa: B018
    with pytest.raises(ValueError, match="gave -3.0"):  # nothing was consumed by the failure
        meter.recent  # noqa: B018
