"""A run budgeted in optimizer steps: ``for x in ckpt.batches(steps=N)``.

The batches come across epochs until the run has made N optimizer steps in all (a
resumed run makes only those left), then the last checkpoint is saved and waited for
without a hand-written call. A finished run started again yields no batch, so it runs
no forward or backward. The weights match a hand-written loop's bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import cudakit

DATA = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))


def _parts(accumulate: int = 1) -> tuple[torch.nn.Module, Any, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cudakit.autocast_step(opt, accumulate=accumulate)

    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    return model, step, train, torch.utils.data.DataLoader(DATA, batch_size=2)  # 4 a epoch


def _ckpt(directory: Path, step: Any, model: Any, loader: Any, **kw: Any) -> Any:
    return cudakit.Checkpointer(
        directory, model=model, step=step, loader=loader, preemption=False, **kw
    )


def _hand_written(steps: int, accumulate: int = 1) -> torch.nn.Module:
    model, _, train, loader = _parts(accumulate)
    calls = 0
    while calls < steps * accumulate:
        for x in loader:
            train(x)
            calls += 1
            if calls == steps * accumulate:
                break
    return model


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_budget_runs_across_epochs_and_saves_its_last_checkpoint(tmp_path: Path) -> None:
    model, step, train, loader = _parts()
    with _ckpt(tmp_path, step, model, loader, every=4) as ckpt:
        seen = 0
        for x in ckpt.batches(steps=10):
            train(x)
            seen += 1
        assert seen == 10
        assert ckpt.position == cudakit.Position(epoch=2, batch=2, total=10, windows=10)
        # every 4 steps, and the budget's end without a save() of the user's
        assert ckpt.latest is not None
        assert ckpt.latest.name.endswith("10")
    assert len(_names(tmp_path)) == 3  # steps 4, 8 and 10
    for a, b in zip(model.parameters(), _hand_written(10).parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_finished_run_started_again_runs_no_step(tmp_path: Path) -> None:
    model, step, train, loader = _parts()
    with _ckpt(tmp_path, step, model, loader) as ckpt:
        for x in ckpt.batches(steps=6):
            train(x)
    names = _names(tmp_path)
    model, step, train, loader = _parts()
    with _ckpt(tmp_path, step, model, loader) as ckpt:
        batches = list(ckpt.batches(steps=6))
        assert batches == []
        assert ckpt.resumed_from is not None
        assert ckpt.position.windows == 6
    assert _names(tmp_path) == names  # nothing saved again
    for a, b in zip(model.parameters(), _hand_written(6).parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_stopped_run_makes_only_the_steps_left(tmp_path: Path) -> None:
    model, step, train, loader = _parts()
    with _ckpt(tmp_path, step, model, loader, every=3) as ckpt:
        for i, x in enumerate(ckpt.batches(steps=10)):
            train(x)
            if i == 6:  # the 7th step ran; the last checkpoint is step 6
                break
    model, step, train, loader = _parts()
    with _ckpt(tmp_path, step, model, loader, every=3) as ckpt:
        seen = 0
        for x in ckpt.batches(steps=10):
            train(x)
            seen += 1
        assert ckpt.resumed_from is not None
        assert ckpt.resumed_from.name.endswith("6")
    assert seen == 4
    for a, b in zip(model.parameters(), _hand_written(10).parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_larger_budget_continues_a_finished_run(tmp_path: Path) -> None:
    model, step, train, loader = _parts()
    with _ckpt(tmp_path, step, model, loader) as ckpt:
        for x in ckpt.batches(steps=3):
            train(x)
    model, step, train, loader = _parts()
    with _ckpt(tmp_path, step, model, loader) as ckpt:
        seen = 0
        for x in ckpt.batches(steps=9):
            train(x)
            seen += 1
    assert seen == 6
    for a, b in zip(model.parameters(), _hand_written(9).parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_budget_counts_optimizer_steps_not_micro_batches(tmp_path: Path) -> None:
    model, step, train, loader = _parts(accumulate=3)
    with _ckpt(tmp_path, step, model, loader) as ckpt:
        seen = 0
        for x in ckpt.batches(steps=3):
            train(x)
            seen += 1
        assert ckpt.position.windows == 3
    assert seen == 9  # three windows of three, across the first epoch's end
    assert step.position == 0
    for a, b in zip(model.parameters(), _hand_written(3, 3).parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("steps", "error", "words"),
    [("3", TypeError, "got str '3'"), (2.5, TypeError, "got float"), (-1, ValueError, "-1")],
)
def test_a_bad_budget_raises_at_the_call(
    tmp_path: Path, steps: Any, error: type[Exception], words: str
) -> None:
    model, step, _, loader = _parts()
    with _ckpt(tmp_path, step, model, loader) as ckpt:
        with pytest.raises(error, match=r"Checkpointer\.batches\(steps=...\) expects an int >= 0"):
            ckpt.batches(steps=steps)  # no next(): the call itself raises
        assert ckpt.resumed_from is None
    with _ckpt(tmp_path, step, model, loader) as ckpt, pytest.raises(error) as info:
        ckpt.batches(steps=steps)
    assert words in str(info.value)


def test_a_loader_without_batches_cannot_fill_a_budget(tmp_path: Path) -> None:
    model, step, _, _ = _parts()
    empty = torch.utils.data.DataLoader(torch.randn(0, 4), batch_size=2)
    with (
        _ckpt(tmp_path, step, model, empty) as ckpt,
        pytest.raises(
            ValueError,
            match=r"Checkpointer\.batches\(steps=5\): the loader yielded no batch in epoch 0, "
            r"so no step of the 5 can run",
        ),
    ):
        list(ckpt.batches(steps=5))
