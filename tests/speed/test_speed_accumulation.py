"""Calls grouped into optimizer steps (accumulation) and FLOPs scaled to batches of any size."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cudakit.amp import StepResult, autocast_step
from cudakit.speed import count_flops, speed_report


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_accumulate_groups_calls_into_steps() -> None:
    meter = speed_report(samples=len, accumulate=3, file=None)
    for n in [1, 2, 3, 4, 5, 6, 7]:
        with meter.measure(list(range(n))):
            pass
    assert (meter.calls, meter.steps) == (7, 2)
    total = meter.total
    assert (total.steps, total.calls, total.samples) == (2, 6, 21.0)  # the open window waits
    assert total.step_time == pytest.approx(total.seconds / 2)


def test_decorated_autocast_step_windows_are_the_steps() -> None:
    model, opt = _model()
    step = autocast_step(opt, model=model, dtype=torch.float32, accumulate=4)

    @speed_report(samples=len, file=None)
    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    for n in range(1, 11):
        train(torch.ones(n, 4))
    meter = train.speed_report
    assert (meter.calls, meter.steps, step.steps, step.position) == (10, 2, 2, 2)
    assert meter.total.samples == sum(range(1, 9))
    assert meter.peak.dtype == "fp32"  # read from the step
    step.flush()  # the last window, stepped outside the meter: closed at the next call
    train(torch.ones(1, 4))
    assert meter.steps == 3
    assert meter.total.samples == sum(range(1, 11))
    assert meter.label == "train"


def test_explicit_form_with_step_given() -> None:
    model, opt = _model()
    step = autocast_step(opt, model=model, dtype=torch.float32, accumulate=2)
    meter = speed_report(samples=len, step=step, file=None)
    for _ in range(5):
        x = torch.ones(3, 4)
        with meter.measure(x):
            with step:
                loss = model(x).square().mean()
            step.backward(loss)
    assert (meter.steps, meter.calls, meter.total.samples) == (2, 5, 12.0)
    # A function the step decorated names the same step.
    assert speed_report(step=step(lambda x: model(x).sum()), file=None)._settings.step is step


def test_step_result_returned_by_a_plain_function_marks_the_window(skip_on: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)  # the sync-free path
    step = autocast_step(opt, dtype=torch.float32, accumulate=3)
    inner = step(lambda x: model(x).square().mean())

    @speed_report(file=None)
    def train(x: torch.Tensor) -> StepResult:
        return inner(x)

    results = [train(torch.ones(2, 4)) for _ in range(7)]
    assert (train.speed_report.steps, train.speed_report.calls) == (2, 7)
    assert step.steps == 2
    assert [bool(r.stepped) for r in results] == [False, False, True] * 2 + [False]


def test_flops_scale_with_the_batch_size() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def loss(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    flops = count_flops(loss, torch.randn(8, 8), model=model)
    meter = speed_report(samples=len, flops=flops, file=None)
    sizes = [3, 8, 17, 1]
    for n in sizes:
        x = torch.randn(n, 8)
        with meter.measure(x):
            loss(x).backward()
    exact = sum(count_flops(loss, torch.randn(n, 8), model=model).total for n in sizes)
    assert meter.total.flops == pytest.approx(exact)
    assert meter.total.samples == sum(sizes)


def test_flops_scale_with_the_tokens_when_given() -> None:
    model = nn.Linear(8, 8)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    flops = count_flops(loss, torch.randn(2, 5, 8), model=model)
    meter = speed_report(
        samples=len, tokens=lambda b: b.shape[0] * b.shape[1], flops=flops, file=None
    )
    shapes = [(2, 5), (4, 3), (1, 11)]  # sequences of any length
    for shape in shapes:
        with meter.measure(torch.randn(*shape, 8)):
            pass
    exact = sum(count_flops(loss, torch.randn(*s, 8), model=model).total for s in shapes)
    assert meter.total.flops == pytest.approx(exact)
    assert meter.total.tokens == 10 + 12 + 11


def test_flops_of_a_function_and_counts_as_tensors() -> None:
    meter = speed_report(
        tokens=lambda b: b["mask"].sum(), flops=lambda b: 6.0 * b["mask"].sum(), file=None
    )
    masks = [torch.tensor([1, 1, 0]), torch.tensor([1, 0, 0]), torch.tensor([1, 1, 1])]
    for mask in masks:
        with meter.measure({"mask": mask}):
            pass
    assert (meter.total.tokens, meter.total.flops, meter.total.samples) == (6.0, 36.0, None)


def test_fixed_flops_and_counts_per_call() -> None:
    meter = speed_report(samples=4, tokens=16, flops=100, file=None)
    for _ in range(3):
        with meter:
            pass
    with meter.measure(samples=1, tokens=torch.tensor(2)):
        pass
    t = meter.total
    assert (t.samples, t.tokens, t.flops, t.calls) == (13.0, 50.0, 400.0, 4)


segments = st.lists(
    st.tuples(
        st.integers(1, 4),  # accumulate of the segment
        st.integers(0, 3),  # full windows
        st.integers(0, 3),  # micro-steps of a partial window, then flush()
        st.lists(st.integers(0, 9), min_size=16, max_size=16),  # samples of each call
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=25)
@given(segments, st.integers(1, 4))
def test_counts_follow_any_accumulation_schedule(
    schedule: list[tuple[int, int, int, list[int]]], window: int
) -> None:
    model, opt = _model()
    step = autocast_step(opt, model=model, dtype=torch.float32)

    @speed_report(samples=lambda n: n, window=window, file=None)
    @step
    def train(n: int) -> torch.Tensor:
        return model(torch.ones(1, 4)).sum() * 0

    per_step: list[int] = []  # the samples of each optimizer step, in order
    calls = 0
    for accumulate, full, partial, samples in schedule:
        step.accumulate = accumulate
        todo = samples[: accumulate * full + partial % accumulate]
        for i, n in enumerate(todo):
            train(n)
            calls += 1
            if i % accumulate == 0:
                per_step.append(0)
            per_step[-1] += n
        if partial % accumulate:
            step.flush()
    meter = train.speed_report  # a last flush() is seen when the figures are read
    assert meter.calls == calls
    assert meter.steps == len(per_step) == step.steps
    total, recent = meter.total, meter.recent
    assert (total.steps, total.calls, total.samples) == (len(per_step), calls, sum(per_step))
    assert recent.steps == min(window, len(per_step))
    assert recent.samples == sum(per_step[len(per_step) - recent.steps :])


@settings(max_examples=25)
@given(st.integers(1, 5), st.lists(st.integers(0, 9), max_size=20))
def test_counts_with_a_fixed_accumulate(accumulate: int, samples: list[int]) -> None:
    meter: Any = speed_report(samples=lambda n: n, accumulate=accumulate, window=2, file=None)
    for n in samples:
        with meter.measure(n):
            pass
    closed = len(samples) // accumulate * accumulate
    assert (meter.calls, meter.steps) == (len(samples), len(samples) // accumulate)
    assert meter.total.samples == sum(samples[:closed])
    last = samples[max(0, closed - 2 * accumulate) : closed]
    assert meter.recent.samples == sum(last)


def test_loss_does_not_enter_the_count() -> None:
    model, _ = _model()
    flops = count_flops(
        lambda x: F.mse_loss(model(x), torch.zeros(2, 1)), torch.ones(2, 4), model=model
    )
    assert flops.total == 2 * 2 * 4 * 1 * 2


def test_numpy_numbers_count_like_python_numbers() -> None:
    np = pytest.importorskip("numpy")
    meter = speed_report(samples=np.int64(4), tokens=lambda b: np.int32(b), file=None)
    for n in (1, 2):
        with meter.measure(n):
            pass
    assert (meter.total.samples, meter.total.tokens) == (8.0, 3.0)


class Batch(torch.Tensor):
    """A tensor subclass: ``len`` goes through its own ``__len__``."""

    def __len__(self) -> int:
        return 5


@given(
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    kind=st.sampled_from(["tensor", "list", "subclass"]),
)
@settings(max_examples=40, deadline=None)
def test_samples_len_counts_what_len_says(shape: list[int], kind: str) -> None:
    """``samples=len`` reads a plain tensor's first size directly: the same number."""
    t = torch.zeros(shape)
    batch = {"tensor": t, "list": t.tolist(), "subclass": t.as_subclass(Batch)}[kind]
    meter = speed_report(samples=len, file=None)
    for _ in range(3):
        with meter.measure(batch):
            pass
    assert meter.total.samples == 3 * len(batch)
    model, opt = _model()  # the decorator over a step: its own counting function
    step = autocast_step(opt, dtype=torch.float32)

    @speed_report(samples=len, tokens=7, file=None)
    @step
    def train(batch: Any) -> torch.Tensor:
        return model.weight.sum()

    for _ in range(3):
        train(batch)
    total = train.speed_report.total
    assert (total.samples, total.tokens) == (3 * len(batch), 21.0)


def test_samples_len_of_a_0d_tensor_is_refused_as_len_refuses_it() -> None:
    meter = speed_report(samples=len, file=None)
    zero_d = meter.measure(torch.tensor(3.0))
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d tensor"), zero_d:
        pass


@pytest.mark.parametrize("read_between", [False, True])
def test_a_window_closed_by_flush_writes_the_line_due_at_its_step(read_between: bool) -> None:
    """A flushed window that reaches a log step gets its line: at the next call, also when
    a figure was read in between (a read closes the window but writes nothing)."""
    model = torch.nn.Linear(4, 1)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.01), model=model, accumulate=2)
    lines: list[str] = []

    @speed_report(samples=len, every=3, log=lines.append)
    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    for epoch in range(2):
        for _ in range(5):  # two full windows and one of one call
            train(torch.ones(3, 4))
        step.flush()
        if read_between:
            assert train.speed_report.steps == 3 * (epoch + 1)
            assert len(lines) == epoch  # the read writes nothing
    train(torch.ones(3, 4))
    assert [line.split(":")[0] for line in lines] == [
        "speed_report 'train' cpu step 3",
        "speed_report 'train' cpu step 6",
    ]
    assert "[last 6 steps]" in lines[1]
