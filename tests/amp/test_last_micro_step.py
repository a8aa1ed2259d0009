"""``step.last_micro_step()``: who enters it, when it may be entered, what it changes.

Under DDP and FSDP2 the epoch's last micro-step syncs inside it (tests/amp/
test_epoch_end_syncs_a_partial_window.py); here, on one process: it is refused
once a micro-step has decided how it syncs, it nests, it changes no bits without a
process group, and ``Checkpointer.batches()`` and ``prefetch(loader, step=step)``
enter it for the epoch's last batch, and only where that batch is known.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cudakit
from cudakit.amp import AutocastStep, autocast_step


def _step(accumulate: int = 3) -> tuple[torch.nn.Module, AutocastStep]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, autocast_step(opt, model=model, dtype=torch.float32, accumulate=accumulate)


def _loss(model: torch.nn.Module, i: int = 0) -> torch.Tensor:
    return model(torch.full((2, 3), float(i + 1))).pow(2).mean()


def test_it_is_refused_once_the_micro_step_has_decided_how_it_syncs() -> None:
    model, step = _step()
    with step:
        loss = _loss(model)
        with pytest.raises(RuntimeError, match=r"last_micro_step\(\) entered inside `with step:`"):
            step.last_micro_step().__enter__()
    with pytest.raises(RuntimeError, match=r"Enter it around the whole micro-step"):
        step.last_micro_step().__enter__()  # between the block and its backward
    step.backward(loss)

    def inside(x: torch.Tensor) -> torch.Tensor:
        with step.last_micro_step():
            return _loss(model)

    with pytest.raises(RuntimeError, match=r"or the step function"):
        step(inside)(torch.ones(1))
    assert step.position == 1  # the refused call ran no backward


def test_it_nests_and_puts_the_flag_back() -> None:
    model, step = _step()
    with step.last_micro_step():
        with step.last_micro_step():
            pass
        step.backward(_loss(model))  # still inside the outer one
    with step.last_micro_step(), contextlib.suppress(KeyError):
        raise KeyError
    # Outside: a micro-step is an ordinary one again (no step until the window is full).
    assert not step.backward(_loss(model, 1)).stepped
    assert step.backward(_loss(model, 2)).stepped


def test_without_a_process_group_it_changes_nothing() -> None:
    results = []
    for mark in (False, True):
        model, step = _step()
        for i in range(5):
            with step.last_micro_step() if mark and i == 4 else contextlib.nullcontext():
                step.backward(_loss(model, i))
        assert step.flush().stepped
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(results[0], results[1])


@pytest.fixture
def entered(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The position of each step when last_micro_step() is entered (recorded)."""
    log: list[int] = []
    original = AutocastStep.last_micro_step

    @contextlib.contextmanager
    def recording(self: AutocastStep) -> Iterator[None]:
        log.append(self.position)
        with original(self):
            yield

    monkeypatch.setattr(AutocastStep, "last_micro_step", recording)
    return log


class _Unsized(torch.utils.data.IterableDataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([torch.tensor([float(i)]) for i in range(self.n)])


@given(n=st.integers(0, 7), sized=st.booleans())
def test_prefetch_with_a_step_enters_it_for_the_last_batch_only(n: int, sized: bool) -> None:
    _, step = _step()
    inside = []
    source: Any = (
        list(_Unsized(n)) if sized else torch.utils.data.DataLoader(_Unsized(n), batch_size=None)
    )
    batches = cudakit.prefetch(source, "cpu", step=step)
    assert batches.step is step
    for _ in range(2):  # every epoch
        seen = [(b.item(), step._window.ends) for b in batches]
        inside.append(seen)
    expected = [(float(i), i == n - 1) for i in range(n)]
    assert inside == [expected, expected]
    assert not step._window.ends


def test_prefetch_takes_the_decorated_function_and_refuses_anything_else() -> None:
    model, step = _step()
    fn = step(lambda x: _loss(model))
    assert cudakit.prefetch([torch.ones(1)], "cpu", step=fn).step is step
    with pytest.raises(TypeError, match=r"prefetch\(step=...\) expects an autocast_step"):
        cudakit.prefetch([torch.ones(1)], "cpu", step=model)


def test_prefetch_reading_ahead_raises_an_error_after_the_batch_before_it() -> None:
    _, step = _step()

    def source() -> Iterator[torch.Tensor]:
        yield torch.zeros(1)
        raise OSError("disk gone")

    got = []

    def loop() -> None:
        for b in cudakit.prefetch(source(), "cpu", step=step):
            got.append((b.item(), step._window.ends))

    with pytest.raises(OSError, match="disk gone"):
        loop()
    assert got == [(0.0, False)]  # delivered, and not marked as the last


def test_batches_enters_it_for_the_epochs_last_batch_when_the_length_is_known(
    tmp_path: Path, entered: list[int]
) -> None:
    model, step = _step()
    fn = step(lambda x: _loss(model))
    loader = torch.utils.data.DataLoader(torch.randn(10, 3), batch_size=2)  # 5 batches
    ckpt = cudakit.Checkpointer(tmp_path / "a", step=step, loader=loader, preemption=False)
    for _ in ckpt.epochs(2):
        for x in ckpt.batches():
            fn(x)
        fn.flush()
    ckpt.close()
    assert entered == [1, 1]  # once an epoch, at the partial window's second micro-step
    entered.clear()
    unsized = torch.utils.data.DataLoader(_Unsized(5), batch_size=None)
    ckpt = cudakit.Checkpointer(tmp_path / "b", step=step, loader=unsized, preemption=False)
    for _ in ckpt.epochs(1):
        for x in ckpt.batches():
            fn(x)
        fn.flush()
    ckpt.close()
    assert entered == []  # no len(): unknown, and flush() reduces (or refuses a hook)
