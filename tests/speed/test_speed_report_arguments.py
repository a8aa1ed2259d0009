"""Every refusal of speed_report and its meter: the type, and the message that names the fix."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from cudakit.amp import autocast_step
from cudakit.exceptions import DeviceError
from cudakit.speed import FlopCount, speed_report


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"samples": "32"},
            TypeError,
            r"speed_report\(samples=...\) expects a number >= 0 per "
            r"call, a function of the batch, or None, got str '32'. For example: samples=len",
        ),
        ({"samples": True}, TypeError, r"speed_report\(samples=...\) expects a number"),
        ({"samples": -1}, ValueError, r"speed_report\(samples=...\) expects a number >= 0"),
        (
            {"tokens": float("nan")},
            ValueError,
            r"speed_report\(tokens=...\) expects .* For "
            r"example: tokens=lambda batch",
        ),
        (
            {"flops": "1e9"},
            TypeError,
            r"speed_report\(flops=...\) expects a number >= 0 per "
            r"call, a function of the batch, a FlopCount, or None",
        ),
        ({"accumulate": "2"}, TypeError, r"speed_report\(accumulate=...\) expects an int >= 1"),
        ({"accumulate": 0}, ValueError, r"speed_report\(accumulate=...\) expects an int >= 1"),
        (
            {"step": 3},
            TypeError,
            r"speed_report\(step=...\) expects an autocast_step\(...\) "
            r"object or a function it decorated, got int 3",
        ),
        ({"every": 0}, ValueError, r"speed_report\(every=...\) expects an int >= 1, got int 0"),
        ({"every": 1.5}, TypeError, r"speed_report\(every=...\) expects an int >= 1"),
        (
            {"window": None},
            TypeError,
            r"speed_report\(window=...\) expects an int >= 1.*"
            r"window=100",
        ),
        ({"window": 0}, ValueError, r"speed_report\(window=...\) expects an int >= 1"),
        (
            {"peak_tflops": 0},
            ValueError,
            r"speed_report\(peak_tflops=...\) expects a positive "
            r"finite number, got int 0. It is the device's dense peak",
        ),
        (
            {"peak_tflops": "989"},
            TypeError,
            r"speed_report\(peak_tflops=...\) expects a "
            r"positive finite number",
        ),
        ({"peak_tflops": float("inf")}, ValueError, r"speed_report\(peak_tflops=...\)"),
        ({"combine": "yes"}, TypeError, r"speed_report\(combine=...\) expects True or False"),
        (
            {"dtype": torch.int8},
            ValueError,
            r"speed_report\(dtype=...\) expects a floating "
            r"torch.dtype or one of 'fp32', 'tf32', 'bf16', 'fp16', 'fp8', got dtype torch.int8",
        ),
        ({"dtype": "bf17"}, ValueError, r"speed_report\(dtype=...\) expects .* got str 'bf17'"),
        ({"dtype": 16}, TypeError, r"speed_report\(dtype=...\) expects a floating torch.dtype"),
        ({"device": "gpu"}, DeviceError, r"speed_report\(device='gpu'\): unknown device 'gpu'"),
        (
            {"device": "meta"},
            DeviceError,
            r"speed_report\(device='meta'\): nothing runs on the "
            r"meta device",
        ),
        ({"device": 2.5}, TypeError, r"speed_report\(device=2.5\)"),
        (
            {"file": io.BytesIO()},
            TypeError,
            r"speed_report\(file=...\) expects a text stream "
            r"with .write\(\) .* got BytesIO .* It is a binary stream",
        ),
        ({"file": 3}, TypeError, r"speed_report\(file=...\) expects a text stream .* got int 3"),
        (
            {"log": 3},
            TypeError,
            r"speed_report\(log=...\) expects a logging.Logger or a "
            r"callable",
        ),
    ],
)
def test_argument_errors(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        speed_report(**kwargs)


def test_label_error() -> None:
    with pytest.raises(
        TypeError,
        match=r"speed_report\(label=\.\.\.\) expects a string naming what is "
        r"measured, or None, got int 3. For example: speed_report\('train'\)",
    ):
        speed_report(3)  # type: ignore[call-overload]


def _step() -> Any:
    model = torch.nn.Linear(2, 1)
    return autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.float32)


def test_step_and_accumulate_together() -> None:
    step = _step()
    with pytest.raises(
        ValueError,
        match=r"speed_report\(\) got both step= and accumulate=2: "
        r"the step says when a window ends .* Drop accumulate=",
    ):
        speed_report(step=step, accumulate=2)
    meter = speed_report(accumulate=2, file=None)
    with pytest.raises(
        ValueError,
        match=r"speed_report\(accumulate=2\) decorates '.*<lambda>', "
        r"an autocast_step function .* Drop accumulate=",
    ):
        meter(step(lambda x: x.sum()))


def test_flop_count_scaling_errors() -> None:
    empty = FlopCount(100, 50, [])
    with pytest.raises(
        ValueError,
        match=r"speed_report\(flops=...\) scales the counted FLOPs "
        r"by samples, but samples of the FlopCount's example batch is 0",
    ):
        speed_report(samples=len, flops=empty)
    with pytest.raises(
        TypeError,
        match=r"speed_report\(tokens=...\) expects a number >= 0 or a "
        r"one-element tensor for each call, got str 'x'",
    ):
        speed_report(tokens=lambda b: "x", flops=empty)
    with pytest.raises(
        ValueError,
        match=r"speed_report\(tokens=...\) gave -2.0 for the "
        r"FlopCount's example batch",
    ):
        speed_report(tokens=lambda b: torch.tensor(-2), flops=empty)


def test_decorator_errors() -> None:
    meter = speed_report(file=None)
    with pytest.raises(
        TypeError,
        match=r"speed_report\(func=\.\.\.\) expects a function to decorate, "
        r"got int 3",
    ):
        meter(3)  # type: ignore[arg-type]

    def gen() -> Any:
        yield 1

    with pytest.raises(
        TypeError,
        match=r"speed_report cannot decorate the generator or "
        r"coroutine function '.*gen'.*meter.measure\(batch\)",
    ):
        meter(gen)


def test_block_errors() -> None:
    meter = speed_report(samples=len, file=None)
    with (
        pytest.raises(
            RuntimeError,
            match=r"speed_report\(samples=len\) counts from the batch, "
            r"but this block was given none: write `with meter.measure\(batch\):`",
        ),
        meter,
    ):
        pass
    with (
        meter.measure([1]) as inner,
        pytest.raises(
            RuntimeError,
            match=r"this speed_report\(''\) is already measuring "
            r"a call; one object measures one call at a time",
        ),
    ):
        inner.__enter__()
    with pytest.raises(RuntimeError, match=r"speed_report.__exit__ called without __enter__"):
        meter.__exit__(None, None, None)
    assert meter.calls == 1


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            "x",
            TypeError,
            r"speed_report\(samples=...\) expects a number >= 0 or a one-element "
            r"tensor for each call, got str 'x'",
        ),
        (
            -1,
            ValueError,
            r"speed_report\(samples=...\) expects a finite number >= 0 for each call, "
            r"got int -1",
        ),
        (
            torch.ones(2),
            ValueError,
            r"speed_report\(samples=...\) got a tensor of shape \(2,\) "
            r"and dtype torch.float32 for one call; it expects one number",
        ),
        (torch.tensor(True), ValueError, r"got a tensor of shape \(\) and dtype torch.bool"),
    ],
)
def test_count_errors(value: object, error: type[Exception], message: str) -> None:
    meter = speed_report(file=None)
    with pytest.raises(error, match=message):
        meter.measure(samples=value)  # type: ignore[arg-type]
    fn = speed_report(samples=lambda b: value, file=None)
    with pytest.raises(error, match=message), fn.measure([]):
        pass
    assert fn.calls == 0  # a refused count adds nothing


def test_a_failed_write_names_the_file() -> None:
    class Full(io.StringIO):
        def write(self, s: str) -> int:
            raise OSError(28, "No space left on device")

    target = Full()
    meter = speed_report(every=1, file=target)
    with pytest.raises(OSError, match="No space left") as info, meter:
        pass
    assert any("speed_report could not write its line to" in n for n in info.value.__notes__)
    assert meter.steps == 1
    assert meter.last_line is not None
