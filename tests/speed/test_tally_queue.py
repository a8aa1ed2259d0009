"""The tally queues calls and adds them to their steps in batches: the figures are as if
every call had been added at once, whatever the order of calls, flushes and reads."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cudakit.speed._clock import WallClock
from cudakit.speed._tally import BATCH, Tally

# An action: ("call", seconds, samples, ends, ready, tensor), ("flush",) or ("read",);
# ready: the call's device mark has passed; tensor: its count is a tensor (read later).
actions = st.lists(
    st.one_of(
        st.tuples(
            st.just("call"),
            st.sampled_from([0.25, 0.5, 1.0, 2.0]),
            st.integers(0, 9),
            st.booleans(),
            st.booleans(),
            st.booleans(),
        ),
        st.just(("flush",)),
        st.just(("read",)),
    ),
    max_size=3 * BATCH,
)


def _reference(plan: list[Any], window: int) -> tuple[list[list[float]], int, int]:
    """Closed steps as [calls, seconds, samples], with the calls and the open calls."""
    closed: list[list[float]] = []
    open_step = [0, 0.0, 0.0]
    calls = 0
    for action in plan:
        if action[0] == "call":
            _, seconds, samples, ends, *_ = action
            open_step = [open_step[0] + 1, open_step[1] + seconds, open_step[2] + samples]
            calls += 1
            if ends:
                closed.append(open_step)
                open_step = [0, 0.0, 0.0]
        elif action[0] == "flush" and open_step[0]:
            closed.append(open_step)
            open_step = [0, 0.0, 0.0]
    return closed, calls, open_step[0]


@given(plan=actions, window=st.integers(1, 5))
@settings(max_examples=150, deadline=None)
def test_batched_adds_give_the_figures_of_immediate_ones(plan: list[Any], window: int) -> None:
    tally = Tally(WallClock(), window)
    for i, action in enumerate(plan):
        if action[0] == "call":
            _, seconds, samples, ends, *_ = action
            assert tally.add(seconds, samples, 0, 0, ends) is ends
        elif action[0] == "flush":
            tally.end_window()
        else:
            closed, calls, open_calls = _reference(plan[: i + 1], window)
            tally.resolve()
            assert (tally.steps, tally.calls, tally.open_calls) == (len(closed), calls, open_calls)
            assert tally.total().samples == sum(s[2] for s in closed)
        assert len(tally._queue) < BATCH
    closed, calls, open_calls = _reference(plan, window)
    assert (tally.steps, tally.calls, tally.open_calls) == (len(closed), calls, open_calls)
    tally.resolve()
    total, recent = tally.total(), tally.recent()
    assert (total.steps, total.calls) == (len(closed), sum(s[0] for s in closed))
    assert total.seconds == sum(s[1] for s in closed)
    assert total.samples == sum(s[2] for s in closed)
    last = closed[-window:] if closed else []
    assert (recent.steps, recent.calls) == (len(last), sum(s[0] for s in last))
    assert recent.samples == sum(s[2] for s in last)


class Mark:
    """An event pair's stand-in: seconds known once the device has passed it."""

    def __init__(self, seconds: float, ready: bool) -> None:
        self.value = seconds
        self.passed = ready


class FakeClock:
    """Marks that may not be ready: folding waits for them, a read takes them."""

    @staticmethod
    def ready(mark: Mark) -> bool:
        return mark.passed

    @staticmethod
    def seconds(mark: Mark) -> float:
        return mark.value


@given(
    plan=actions,
    window=st.integers(1, 3),
)
@settings(max_examples=100, deadline=None)
def test_kept_marks_and_tensor_counts_fold_and_read_alike(plan: list[Any], window: int) -> None:
    """Device marks and tensor counts: kept, folded once steps leave the window, read."""
    import torch

    tally = Tally(FakeClock(), window)  # type: ignore[arg-type]
    calls = [a[:4] for a in plan if a[0] == "call"]
    marks: list[Mark] = []
    for action in plan:
        if action[0] == "call":
            _, seconds, samples, ends, ready, tensor = action
            count: Any = torch.tensor(samples) if tensor else samples
            marks.append(Mark(seconds, ready))
            if len(marks) > 5:
                marks[-6].passed = True  # the device is at most five calls behind
            tally.add(marks[-1], count, 0, 0, ends)
        elif action[0] == "flush":
            tally.end_window()
        else:
            tally.resolve()
        assert len(tally._kept) <= tally._fold_at + 2 * BATCH + 10
    closed, n_calls, open_calls = _reference(plan, window)
    assert len(calls) == n_calls
    tally.resolve()
    total, recent = tally.total(), tally.recent()
    assert (total.steps, total.calls) == (len(closed), sum(s[0] for s in closed))
    assert total.seconds == sum(s[1] for s in closed)
    assert total.samples == sum(s[2] for s in closed)
    last = closed[-window:] if closed else []
    assert (recent.steps, recent.seconds, recent.samples) == (
        len(last),
        sum(s[1] for s in last),
        sum(s[2] for s in last),
    )
    assert tally.open_calls == open_calls


def test_a_long_unread_run_folds_through_the_queue() -> None:
    """No read for 300 calls: queued calls join their steps, and old ones fold."""
    import torch

    tally = Tally(FakeClock(), 2)  # type: ignore[arg-type]
    marks: list[Mark] = []
    for i in range(300):
        marks.append(Mark(0.5, ready=False))
        if i >= 5:
            marks[i - 5].passed = True  # the device runs five calls behind
        tally.add(marks[-1], torch.tensor(3), 1, 0, ends=i % 3 == 2)
        assert len(tally._kept) <= tally._fold_at + 2 * BATCH + 10
    assert any(tally._deferred)  # tensor counts of folded steps, summed unread
    tally.resolve()
    total, recent = tally.total(), tally.recent()
    assert (total.steps, total.calls, total.seconds, total.samples) == (100, 300, 150.0, 900.0)
    assert (recent.steps, recent.calls, recent.samples, recent.tokens) == (2, 6, 18.0, 6.0)
