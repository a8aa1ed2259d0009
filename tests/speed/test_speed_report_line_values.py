"""What the meter's line carries: the loss (or any scalar) shown, and an advice once.

``meter.show(loss=loss)`` keeps a reference to the value, and the value is read when
the line is written, never at the call: a tensor stays on its device between lines.
An advice (how to get an MFU) is said on the first line it applies to, not on every
line; :attr:`SpeedMeter.mfu_reason` keeps it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import cudakit
from cudakit.speed import speed_report

_ADVICE = "; MFU n/a: no FLOP count; pass flops=count_flops(...)"


def test_the_advice_is_said_once() -> None:
    lines: list[str] = []
    meter = speed_report(every=1, log=lines.append)
    for _ in range(3):
        with meter:
            pass
    assert len(lines) == 3
    assert _ADVICE in lines[0]
    assert [_ADVICE in line for line in lines[1:]] == [False, False]
    assert meter.mfu_reason is not None
    assert meter.mfu_reason.startswith("no FLOP count")


def test_the_peak_advice_is_said_once_too() -> None:
    lines: list[str] = []
    meter = speed_report(every=1, flops=1e6, log=lines.append)
    for _ in range(2):
        with meter:
            pass
    assert "; MFU n/a: the peak table covers NVIDIA GPUs, not cpu; pass peak_tflops=" in lines[0]
    assert "MFU n/a" not in lines[1]
    assert meter.mfu_reason is not None


class _Reads(TorchFunctionMode):
    """Counts the host reads of tensors (``item``, ``__float__``, ``tolist``...)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in ("item", "__bool__", "__float__", "tolist", "__format__"):
            self.n += 1
        return func(*args, **(kw or {}))


def test_the_loss_shown_is_read_only_when_the_line_is_written() -> None:
    lines: list[str] = []
    meter = speed_report(every=4, flops=1e6, log=lines.append)
    with _Reads() as reads:
        for i in range(1, 4):
            with meter:
                loss = torch.tensor(10.0 / i)
            meter.show(loss=loss)
        assert reads.n == 0  # three steps, no line: nothing read
        with meter:
            loss = torch.tensor(2.0)
        meter.show(loss=loss)  # shown after the call that wrote the line: the next one
        with meter:
            pass
    assert len(lines) == 1
    assert lines[0].startswith("speed_report cpu step 4: loss 3.333, ")
    assert reads.n == 1
    meter.flush()
    assert lines[1].startswith("speed_report cpu step 5: loss 2, ")


def test_show_takes_numbers_tensors_and_functions_and_keeps_the_last() -> None:
    meter = speed_report(every=None, file=None)
    calls: list[int] = []

    def lr() -> float:
        calls.append(1)
        return 3e-4

    meter.show(loss=torch.tensor([1.5]), lr=lr, tokens_seen=1_000_000)
    meter.show(loss=torch.tensor(1.25, dtype=torch.bfloat16))
    with meter:
        pass
    assert calls == []  # read when the line is written
    meter.flush()
    assert calls == [1]
    assert meter.last_line is not None
    assert meter.last_line.startswith(
        "speed_report cpu step 1: loss 1.25, lr 0.0003, tokens_seen 1e+06, "
    )
    assert meter.shown == {"loss": 1.25, "lr": 3e-4, "tokens_seen": 1e6}


def test_show_in_a_decorated_step() -> None:
    lines: list[str] = []

    @speed_report(every=2, log=lines.append)
    def train(x: torch.Tensor) -> torch.Tensor:
        return x.sum()

    for i in range(2):
        loss = train(torch.full((2,), float(i)))
        train.speed_report.show(loss=loss)
    train(torch.ones(2))
    train.speed_report.flush()
    assert lines[0].startswith("speed_report 'train' cpu step 2: loss 0, ")
    assert lines[1].startswith("speed_report 'train' cpu step 3: loss 2, ")


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            "low",
            TypeError,
            r"SpeedMeter.show\(loss=...\) expects a number, a one-element tensor or a "
            r"function that returns one, got str 'low'",
        ),
        (
            torch.ones(3),
            ValueError,
            r"SpeedMeter.show\(loss=...\) expects a number, a one-element tensor or a "
            r"function that returns one, got Tensor tensor\(\[1\., 1\., 1\.\]\)\. It has 3 "
            r"elements",
        ),
        (
            True,
            TypeError,
            r"SpeedMeter.show\(loss=...\) expects a number, a one-element tensor or a "
            r"function that returns one, got bool",
        ),
    ],
)
def test_show_refuses_what_is_not_a_scalar(
    value: object, error: type[Exception], message: str
) -> None:
    meter = speed_report(file=None)
    meter.show(loss=1.0)
    with pytest.raises(error, match=message):
        meter.show(acc=0.5, loss=value)
    assert meter.shown == {"loss": 1.0}  # nothing changed


def test_a_function_shown_that_fails_names_its_value() -> None:
    meter = speed_report(every=1, file=None)

    def broken() -> float:
        raise ZeroDivisionError("no")

    meter.show(ratio=broken)
    with pytest.raises(ZeroDivisionError) as info, meter:
        pass
    assert "cudakit.speed_report could not read show(ratio=...) for its line" in "\n".join(
        getattr(info.value, "__notes__", [])
    )


def _loss_run(loss: bool, lines: list[str]) -> tuple[list[float], int]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    step = cudakit.autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)

    @speed_report(every=2, loss=loss, log=lines.append)
    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    with _Reads() as reads:
        results = [train(torch.full((2, 4), float(i))) for i in range(4)]
    return [float(r.loss) for r in results], reads.n


def test_loss_true_shows_the_loss_of_the_call_that_writes_the_line() -> None:
    lines: list[str] = []
    losses, reads = _loss_run(True, lines)
    _, reads_without = _loss_run(False, [])
    assert reads == reads_without + 1  # one line, one read: none at the other calls
    assert len(lines) == 1
    assert lines[0].startswith(f"speed_report 'train' cpu step 2: loss {losses[3]:.4g}, ")


def test_loss_true_takes_a_returned_tensor_and_leaves_other_outputs_out() -> None:
    lines: list[str] = []

    @speed_report(every=1, loss=True, log=lines.append)
    def train(x: torch.Tensor) -> Any:
        return x.sum() if x.numel() else "no loss"

    train(torch.ones(3))
    train(torch.ones(0))
    assert lines[0].startswith("speed_report 'train' cpu step 1: loss 3, ")
    assert "loss" not in lines[1]


def test_shown_inside_a_with_block_is_this_steps_value() -> None:
    lines: list[str] = []
    meter = speed_report(every=1, log=lines.append)
    for i in range(2):
        with meter:
            meter.show(loss=torch.tensor(float(i)))
    assert [line.split(",")[0].split(": ")[1] for line in lines] == ["loss 0", "loss 1"]


def test_a_wrong_loss_switch_is_refused() -> None:
    with pytest.raises(TypeError, match=r"speed_report\(loss=...\) expects True or False, got str"):
        speed_report(loss="yes")  # type: ignore[arg-type]
