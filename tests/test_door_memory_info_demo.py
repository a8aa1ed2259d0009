"""Bad arguments of memory_report, memory_snapshot, device_info and `cudakit demo`,
answered at the door; numbers read from a reused reporter."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from cudakit.demo import main as demo_main
from cudakit.exceptions import DeviceError
from cudakit.info import device_info
from cudakit.memory import MemoryReporter, memory_report, memory_snapshot
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
    assert isinstance(memory_report(device="cpu"), MemoryReporter)


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


def test_a_refused_warmup_device_changes_nothing() -> None:
    model = torch.nn.Linear(2, 2)
    weight = model.weight.detach().clone()
    rng = torch.get_rng_state()
    with pytest.raises(DeviceError):
        warmup(model, torch.ones(1, 2), device="gpu", loss_fn=lambda m, x: m(x).sum())
    assert torch.equal(model.weight, weight)
    assert model.weight.grad is None
    assert torch.equal(torch.get_rng_state(), rng)


# --------------------------------------------------------------------------- device_info


@pytest.mark.parametrize("value", ["no", 1, None])
def test_device_info_init_cuda_must_be_a_bool(value: Any) -> None:
    with pytest.raises(
        TypeError,
        match=r"device_info\(init_cuda=\.\.\.\) expects True or False, got "
        + re.escape(type(value).__name__)
        + r".*Pass init_cuda=True or init_cuda=False",
    ):
        device_info(init_cuda=value)


def test_device_info_refusal_starts_nothing() -> None:
    initialized = torch.cuda.is_initialized()
    with pytest.raises(TypeError):
        device_info(init_cuda="yes")
    assert torch.cuda.is_initialized() == initialized


# --------------------------------------------------------------------------- cudakit demo


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        demo_main(list(argv))
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--seed", "100000000000000000000"],
            r"argument --seed: expected a non-negative integer seed, at most 4611686018427387904; "
            r"got 100000000000000000000\. Use a smaller number\.",
        ),
        (["--seed", "-1"], r"--seed: expected a non-negative integer seed, got -1"),
        (["--seed", "x"], r"--seed: expected a non-negative integer seed, got 'x'"),
        (["--epochs", "100000000000"], r"--epochs: expected a positive integer, at most 10000"),
        (["--train-size", "10" + "0" * 20], r"--train-size: .* at most 1000000; got 10+\."),
        (["--nprocs", "100000"], r"--nprocs: expected a positive integer, at most 256"),
    ],
)
def test_demo_out_of_range_numbers_are_clean_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    err = _error(capsys, *argv)
    assert re.search(message, err), err
    assert "Overflow" not in err


def test_bare_decorator_form_checks_the_other_arguments_too() -> None:
    def step() -> None:
        pass

    with pytest.raises(ValueError, match=r"memory_report\(every=0\) must be at least 1"):
        memory_report(step, every=0)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"memory_report\(file=\.\.\.\) takes a text stream"):
        memory_report(step, file="log.txt")  # type: ignore[call-overload]


def test_time_and_outcome_of_an_open_reporter_are_not_read_as_zero() -> None:
    rep = memory_report("open", device="cpu", file=None)
    with rep:
        with pytest.raises(RuntimeError, match="still open"):
            _ = rep.elapsed
        with pytest.raises(RuntimeError, match="still open"):
            _ = rep.raised
    assert rep.elapsed > 0
