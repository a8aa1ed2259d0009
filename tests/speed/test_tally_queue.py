"""The tally queues calls and adds them to their steps in batches: the figures are as if
every call had been added at once, whatever the order of calls, flushes and reads."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cudakit.speed.clock import WallClock
from cudakit.speed.tally import BATCH, Tally

# An action: ("call", seconds, samples, ends), ("flush",) or ("read",).
actions = st.lists(
    st.one_of(
        st.tuples(
            st.just("call"),
            st.sampled_from([0.5, 1.0, 2.0]),
            st.integers(0, 9),
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
            _, seconds, samples, ends = action
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
            _, seconds, samples, ends = action
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
