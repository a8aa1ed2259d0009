"""memory_report and memory_snapshot at the door: bad arguments answered before anything runs,
and the numbers read from a reused reporter."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cudakit.exceptions import DeviceError
from cudakit.memory import MemoryMeter, memory_report, memory_snapshot
from cudakit.warmup import warmup

FIGURES = (
    "device",
    "peak_allocated",
    "peak_reserved",
    "allocated_before",
    "allocated_after",
    "allocated_delta",
    "reserved_before",
    "reserved_after",
    "reserved_delta",
    "peak_increase",
    "free",
    "total",
)

# --------------------------------------------------------------------------- reused reporter


def test_a_reused_reporter_reads_as_its_latest_report() -> None:
    rep = memory_report("loop", device="cpu", file=None)
    for _ in range(2):
        with rep:
            torch.ones(1024).sum()
    last = rep.last
    assert last is not None
    for name in FIGURES:
        assert getattr(rep, name) == getattr(last, name), name
    assert rep.elapsed == last.elapsed
    assert rep.raised is None
    assert rep.devices == last.devices
    assert rep.figures() == last.figures()


def test_a_decorated_functions_reporter_reads_as_its_latest_call() -> None:
    @memory_report(device="cpu", file=None)
    def step() -> None:
        torch.zeros(10).sum()

    step()
    assert step.memory_report.peak_allocated == step.memory_report.last.peak_allocated  # type: ignore[union-attr]


def test_a_reporter_that_has_not_measured_yet_says_where_the_numbers_come_from() -> None:
    rep = memory_report("fresh", device="cpu", file=None)
    with pytest.raises(
        RuntimeError,
        match=r"memory_report\('fresh'\) has not measured a block yet.*memory_snapshot",
    ):
        _ = rep.peak_allocated


def test_reading_a_reporter_inside_its_block_says_it_is_still_open() -> None:
    rep = memory_report("open", device="cpu", file=None)
    with rep, pytest.raises(RuntimeError, match=r"'open' is still open"):
        _ = rep.allocated_delta


def test_reporter_is_a_memory_reporter() -> None:
    assert isinstance(memory_report(device="cpu"), MemoryMeter)


# --------------------------------------------------------------------------- device= at the door


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: memory_report(device=1.5), TypeError, r"^memory_report\(device=1\.5\): "),
        (
            lambda: memory_report(device="gpu"),
            DeviceError,
            r"^memory_report\(device='gpu'\):.*did you",
        ),
        (lambda: memory_snapshot(1.5), TypeError, r"^memory_snapshot\(device=1\.5\): "),
        (
            lambda: memory_snapshot("gpu"),
            DeviceError,
            r"^memory_snapshot\(device='gpu'\):.*did you",
        ),
        (
            lambda: warmup(torch.nn.Linear(1, 1), torch.ones(1), device=1.5),
            TypeError,
            r"^warmup\(device=1\.5\): ",
        ),
    ],
)
def test_device_errors_name_the_function(call: Any, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("func", [memory_report, memory_snapshot], ids=lambda f: f.__name__)
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "mps"])
def test_memory_device_errors_start_with_the_call(func: Any, device: str) -> None:
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(DeviceError) as info:
        func(device=device)
    assert str(info.value).startswith(f"{func.__name__}(device={device!r}): ")


# --------------------------------------------------------------------------- other arguments


def test_bare_decorator_form_checks_the_other_arguments_too() -> None:
    def step() -> None:
        pass

    with pytest.raises(
        ValueError, match=r"memory_report\(every=\.\.\.\) expects an int >= 1, got int 0"
    ):
        memory_report(step, every=0)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"memory_report\(file=\.\.\.\) expects a text stream"):
        memory_report(step, file="log.txt")  # type: ignore[call-overload]


def test_time_and_outcome_of_an_open_reporter_are_not_read_as_zero() -> None:
    rep = memory_report("open", device="cpu", file=None)
    with rep:
        with pytest.raises(RuntimeError, match="still open"):
            _ = rep.elapsed
        with pytest.raises(RuntimeError, match="still open"):
            _ = rep.raised
    assert rep.elapsed > 0
