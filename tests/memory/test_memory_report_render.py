"""The one renderer of memory reports, and the figures summed over devices."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cudakit._units import format_bytes, format_signed_bytes
from cudakit.memory import DeviceMemory, MemoryReport, MemorySnapshot
from cudakit.memory.results import combine, render

_bytes = st.integers(min_value=0, max_value=2**45)


@st.composite
def _devices(draw: st.DrawFn, cpu: bool | None = None) -> DeviceMemory:
    on_cpu = draw(st.booleans()) if cpu is None else cpu
    a0, a1 = draw(_bytes), draw(_bytes)
    peak = max(a0, a1) + draw(_bytes)
    if on_cpu:
        return DeviceMemory("cpu", a0, a1, peak, free=draw(_bytes), total=2**46)
    r0, r1 = a0 + draw(_bytes), a1 + draw(_bytes)
    return DeviceMemory(
        f"cuda:{draw(st.integers(0, 7))}",
        a0,
        a1,
        peak,
        r0,
        r1,
        max(r0, r1) + draw(_bytes),
        draw(_bytes),
        2**46,
        cuda_started=True,
    )


@given(_devices())
def test_line_and_table_say_the_same_numbers(d: DeviceMemory) -> None:
    line = render(d, "line")[0]
    table = "\n".join(render(d, "table"))
    assert line.startswith(f"{d.device}: peak {format_bytes(d.peak_allocated)} ")
    for text in (line, table):
        assert format_bytes(d.allocated_before) in text
        assert format_bytes(d.allocated_after) in text
        assert format_signed_bytes(d.allocated_delta) in text
        assert f"of {format_bytes(d.total)}" in text
    if d.reserved_before is not None:
        for text in (line, table):
            assert format_bytes(d.peak_reserved) in text
            assert format_signed_bytes(d.reserved_delta) in text
    assert ("RSS" in line) == (d.device == "cpu")
    assert d.line() == line


@given(_devices())
def test_a_snapshot_renders_as_the_device_now(d: DeviceMemory) -> None:
    snap = MemorySnapshot(
        d.device,
        d.allocated_after,
        d.peak_allocated,
        d.reserved_after,
        d.peak_reserved,
        d.free,
        d.total,
        d.cuda_started,
    )
    what = "RSS" if d.device == "cpu" else "allocated"
    now, peak = format_bytes(d.allocated_after), format_bytes(d.peak_allocated)
    assert str(snap).startswith(f"{d.device}: {what} {now} (peak {peak})")


def test_cuda_not_started_is_one_sentence_in_every_layout() -> None:
    d = DeviceMemory("cuda:0", 0, 0, 0, 0, 0, 0, cuda_started=False)
    assert render(d, "line") == ["cuda:0: CUDA not started in this process, nothing allocated"]
    assert render(d, "table") == ["    CUDA not started in this process, nothing allocated"]
    assert str(MemorySnapshot("cuda:0", 0, 0, 0, 0, cuda_started=False)) == render(d, "now")[0]


@given(st.lists(_devices(cpu=False), min_size=2, max_size=4))
def test_several_devices_sum(devices: list[DeviceMemory]) -> None:
    rep = MemoryReport("all", tuple(devices), done=True)
    total = combine(tuple(devices))
    assert rep.figures() == total
    assert rep.peak_allocated == sum(d.peak_allocated for d in devices)
    assert rep.allocated_delta == sum(d.allocated_delta for d in devices)
    assert rep.reserved_delta == sum(d.reserved_delta or 0 for d in devices)
    assert rep.device == ", ".join(d.device for d in devices)


def test_one_device_is_its_own_figures() -> None:
    d = DeviceMemory("cpu", 1, 2, 3)
    assert combine((d,)) is d
