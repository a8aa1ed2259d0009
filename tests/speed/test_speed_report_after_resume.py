"""The meter's step count after a resume: it continues from the resumed position.

``speed_report(start=N)`` counts on from N optimizer steps; a meter passed to a
``Checkpointer`` in ``extra=`` saves its count and takes it back on a resume. The
figures (time per step, samples/s) are those of the steps this process measured.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cudakit
from cudakit.speed import speed_report


def _heads(lines: list[str]) -> list[str]:
    return [line.split(":")[0] for line in lines]


def test_start_continues_the_count() -> None:
    lines: list[str] = []
    meter = speed_report(every=2, start=30, log=lines.append)
    for _ in range(4):
        with meter:
            pass
    assert _heads(lines) == ["speed_report cpu step 32", "speed_report cpu step 34"]
    assert meter.steps == 4  # measured by this process
    assert meter.total.steps == 4
    assert meter.summary().step == 34


def test_a_start_off_the_interval_logs_on_the_interval() -> None:
    lines: list[str] = []
    meter = speed_report(every=10, start=35, log=lines.append)
    for _ in range(16):
        with meter:
            pass
    assert _heads(lines) == ["speed_report cpu step 40", "speed_report cpu step 50"]
    assert "[last 5 steps]" in lines[0]
    assert meter.total.steps == 16


def test_the_decorator_continues_the_count_of_an_autocast_step() -> None:
    model = torch.nn.Linear(4, 1)
    step = cudakit.autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    lines: list[str] = []

    @speed_report(every=2, start=7, log=lines.append)
    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    for _ in range(6):  # three optimizer steps
        train(torch.ones(2, 4))
    assert _heads(lines) == ["speed_report 'train' cpu step 8", "speed_report 'train' cpu step 10"]
    assert train.speed_report.steps == 3


def test_state_dict_round_trip_continues_the_count() -> None:
    first = speed_report(file=None)
    for _ in range(3):
        with first:
            pass
    assert first.state_dict() == {"step": 3}
    lines: list[str] = []
    again = speed_report(every=1, log=lines.append)
    again.load_state_dict(first.state_dict())
    with again:
        pass
    assert _heads(lines) == ["speed_report cpu step 4"]
    assert again.state_dict() == {"step": 4}
    assert again.steps == 1


@pytest.mark.parametrize(
    ("state", "error", "message"),
    [
        (
            [3],
            TypeError,
            r"SpeedMeter.load_state_dict\(state=...\) expects a dict from SpeedMeter.state_dict\(\)"
            r" such as \{'step': 3\}, got list",
        ),
        (
            {"steps": 3},
            ValueError,
            r"SpeedMeter.load_state_dict\(state=...\) expects a dict from SpeedMeter.state_dict\(\)"
            r" such as \{'step': 3\}, got dict",
        ),
        ({"step": -1}, ValueError, r"SpeedMeter.load_state_dict\(step=...\) expects an int >= 0"),
        ({"step": 1.5}, TypeError, r"SpeedMeter.load_state_dict\(step=...\) expects an int >= 0"),
    ],
)
def test_a_wrong_state_is_refused_and_changes_nothing(
    state: object, error: type[Exception], message: str
) -> None:
    meter = speed_report(file=None, start=5)
    with pytest.raises(error, match=message):
        meter.load_state_dict(state)  # type: ignore[arg-type]
    assert meter.state_dict() == {"step": 5}


@pytest.mark.parametrize(
    ("start", "error"), [(-1, ValueError), (True, TypeError), (2.0, TypeError), ("3", TypeError)]
)
def test_a_wrong_start_is_refused(start: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"speed_report\(start=...\) expects an int >= 0, got "):
        speed_report(start=start)  # type: ignore[arg-type]


def _run(directory: Path, epochs: int, lines: list[str]) -> cudakit.Checkpointer:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    step = cudakit.autocast_step(torch.optim.SGD(model.parameters(), lr=0.1))

    @speed_report(every=2, log=lines.append)
    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    data = torch.utils.data.DataLoader(torch.randn(6, 4), batch_size=1)
    ckpt = cudakit.Checkpointer(
        directory,
        step=step,
        model=model,
        loader=data,
        extra={"speed": train.speed_report},
        every=3,
        preemption=False,
    )
    for _ in ckpt.epochs(epochs):
        for x in ckpt.batches():
            train(x)
    ckpt.close()
    return ckpt


def test_a_meter_in_a_checkpoint_continues_after_a_resume(tmp_path: Path) -> None:
    first: list[str] = []
    _run(tmp_path, 1, first)
    assert _heads(first) == [f"speed_report 'train' cpu step {n}" for n in (2, 4, 6)]
    again: list[str] = []
    ckpt = _run(tmp_path, 2, again)  # one more epoch: steps 7 to 12
    assert ckpt.resumed_from is not None
    assert _heads(again) == [f"speed_report 'train' cpu step {n}" for n in (8, 10, 12)]
    assert "[last 2 steps]" in again[0]
    assert again[-1].endswith("[last 6 steps]")  # the figures are this process's steps
