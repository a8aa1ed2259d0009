"""Which rank a failed ``launch()`` blames (``cudakit.parallel._failures.explain``): the rank
that died or hung, and how, never a rank that only suffered it ("Connection reset by
peer", a collective timeout), whatever order the parent saw the ranks end in."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudakit.exceptions import LaunchError
from cudakit.parallel._failures import (
    RankEnd,
    describe_exit,
    exception_line,
    explain,
    is_victim,
    last_seen,
    stack_frames,
)

RESET = (
    "Traceback (most recent call last):\n  ...\nRuntimeError: [../gloo/transport/tcp/pair.cc:537]"
    " Read error [127.0.0.1]:400: Connection reset by peer. This is typically caused by a "
    "remote worker hanging or bugs in the application.\n"
)
CLOSED = "Traceback ...\nRuntimeError: [../pair.cc:553] Connection closed by peer [127.0.0.1]:70\n"
TIMEOUT = (
    "Traceback ...\nRuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
    "waiting 3000ms for recv operation to complete\n"
)
BARRIER = "Traceback ...\nRuntimeError: Rank 1 failed to pass monitoredBarrier in 3000 ms\n"
REAL = "Traceback ...\n  raise ValueError('bad batch')\nValueError: bad batch\n"


def test_a_rank_killed_by_sigkill_is_blamed_not_the_rank_that_saw_the_reset() -> None:
    ends = [
        RankEnd(0, 100, 1, False, RESET, raised_at=10.02, ended_at=10.03),  # the survivor
        RankEnd(1, 101, -9, False, ended_at=10.05),  # seen later than the echo, still the cause
    ]
    err = explain(ends)
    assert isinstance(err, LaunchError)
    first_line = str(err).splitlines()[0]
    assert first_line == (
        "rank 1 of 2 (pid 101) was killed by SIGKILL (exit code -9) without a Python exception, "
        "before returning its result. Look for the OOM killer (`dmesg`, the job's memory limit), "
        "a scheduler or someone running `kill -9`."
    )
    assert "Connection reset by peer" not in first_line
    assert "(then, probably as a consequence: rank 0: RuntimeError:" in str(err)
    assert (err.rank, err.pid, err.exitcode, err.traceback_text) == (1, 101, -9, "")
    assert err.pids == [100, 101]


def test_a_hung_rank_is_blamed_not_the_rank_whose_collective_timed_out() -> None:
    ends = [
        RankEnd(0, 100, 1, False, TIMEOUT, raised_at=13.0, ended_at=13.2),
        RankEnd(1, 101, -15, False),  # still running when launch() stopped it
    ]
    err = explain(ends)
    assert isinstance(err, LaunchError)
    assert str(err).startswith(
        "rank 1 of 2 (pid 101) did not arrive (its stack could not be read). It was still "
        "running when rank 0 gave up waiting for it in a collective, and launch() stopped it.\n"
        "(then, as a consequence: rank 0: RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc"
        ":78] Timed out waiting 3000ms for recv operation to complete)"
    )
    assert (err.rank, err.pid, err.exitcode) == (1, 101, None)


def test_several_hung_ranks_and_several_waiters() -> None:
    ends = [
        RankEnd(0, 100, 1, False, TIMEOUT, raised_at=3.0, ended_at=3.1),
        RankEnd(1, 101, -15, False),
        RankEnd(2, 102, 1, False, BARRIER, raised_at=3.2, ended_at=3.3),
        RankEnd(3, 103, -9, False),  # ignored SIGTERM: launch() sent SIGKILL
    ]
    err = explain(ends)
    assert isinstance(err, LaunchError)
    assert err.rank == 1
    assert "when ranks 0, 2 gave up waiting for it" in str(err)
    assert "(also still running, and stopped: 3)" in str(err)


@pytest.mark.parametrize(
    ("exitcode", "returned", "text"),
    [
        (3, False, "exited with code 3 without a Python exception, before returning its result. "
         "Look for sys.exit() or os._exit()"),
        (0, False, "exited with code 0 without returning a result (sys.exit(0) or a "
         "KeyboardInterrupt in the child?)"),
        (-11, False, "was killed by SIGSEGV (exit code -11) without a Python exception, before "
         "returning its result. Look for a crash in native code"),
        (-6, True, "returned its result, then died while shutting down (killed by SIGABRT, "
         "exit code -6)"),
    ],
)  # fmt: skip
def test_how_a_rank_died_is_said(exitcode: int, returned: bool, text: str) -> None:
    ends = [
        RankEnd(0, 100, 1, False, CLOSED, 5.0, 5.1),
        RankEnd(1, 101, exitcode, returned, "", None, 4.9),
    ]
    err = explain(ends)
    assert isinstance(err, LaunchError)
    assert err.rank == 1
    assert str(err).startswith(f"rank 1 of 2 (pid 101) {text}")


def test_a_real_exception_before_a_signal_death_is_the_cause() -> None:
    ends = [
        RankEnd(0, 100, -6, False, ended_at=2.0),  # gloo aborted after its peer left
        RankEnd(1, 101, 1, False, REAL, raised_at=1.0, ended_at=1.1),
    ]
    err = explain(ends)
    assert isinstance(err, LaunchError)
    assert str(err).startswith(
        "rank 1 of 2 (pid 101) failed: ValueError: bad batch\n"
        "(also: rank 0 was killed by SIGABRT (exit code -6))\n\nTraceback from rank 1:"
    )


def test_only_victims_blame_the_earliest() -> None:
    ends = [
        RankEnd(0, 100, 1, False, CLOSED, raised_at=2.0, ended_at=2.1),
        RankEnd(1, 101, 1, False, RESET, raised_at=1.0, ended_at=1.1),
    ]
    err = explain(ends)
    assert isinstance(err, LaunchError)
    assert err.rank == 1


def test_every_rank_returned_is_no_failure() -> None:
    assert explain([RankEnd(0, 100, 0, True, ended_at=1.0), RankEnd(1, 101, -6, True)]) is None


def test_the_launch_timeout_names_the_ranks_still_running() -> None:
    ends = [RankEnd(0, 100, 0, True, ended_at=1.0), RankEnd(1, 101, -15, False)]
    err = explain(ends, timed_out=2.0)
    assert isinstance(err, LaunchError)
    assert str(err).startswith(
        "launch() timed out after 2s with rank(s) [1] still running; all were killed (rank(s) "
        "[0] had returned their results)."
    )
    assert err.rank is None


@pytest.mark.parametrize("text", [RESET, CLOSED, TIMEOUT, BARRIER])
def test_collective_failures_caused_by_a_peer_are_victims(text: str) -> None:
    assert is_victim(text)


@pytest.mark.parametrize("text", [REAL, "", "Traceback ...\nKeyError: 'label'\n"])
def test_other_failures_are_not_victims(text: str) -> None:
    assert not is_victim(text)


def test_describe_exit() -> None:
    assert describe_exit(-9) == "was killed by SIGKILL (exit code -9)"
    assert describe_exit(-99) == "was killed by signal 99 (exit code -99)"
    assert describe_exit(2) == "exited with code 2"
    assert describe_exit(None) == "was still running"


# --------------------------------------------------------------------------- properties

_KINDS = ("raised", "signal", "exit", "exit0")


@st.composite
def _launch_with_one_cause(draw: st.DrawFn) -> tuple[list[RankEnd], int, str]:
    """A launch where one rank failed first on its own; the rest suffered it or were stopped."""
    n = draw(st.integers(1, 6))
    culprit = draw(st.integers(0, n - 1))
    kind = draw(st.sampled_from(_KINDS))
    t0 = draw(st.floats(0.0, 100.0))
    ends = []
    for rank in range(n):
        if rank == culprit:
            if kind == "raised":
                ends.append(RankEnd(rank, 100 + rank, 1, False, REAL, t0, t0 + 0.01))
            else:
                code = {"signal": draw(st.sampled_from([-9, -11, -6, -15])), "exit": 3, "exit0": 0}
                # the parent may see the death late, after a victim's report
                seen = t0 + draw(st.floats(0.0, 0.5))
                ends.append(RankEnd(rank, 100 + rank, code[kind], False, ended_at=seen))
            continue
        fate = draw(st.sampled_from(("victim", "stopped", "returned")))
        if fate == "victim":
            when = t0 + draw(st.floats(0.001, 2.0))
            text = draw(st.sampled_from([RESET, CLOSED, TIMEOUT, BARRIER]))
            ends.append(RankEnd(rank, 100 + rank, 1, False, text, when, when + 0.01))
        elif fate == "stopped":
            ends.append(RankEnd(rank, 100 + rank, -15, False))
        else:
            ends.append(RankEnd(rank, 100 + rank, 0, True, ended_at=t0 + 1.0))
    return ends, culprit, kind


@given(case=_launch_with_one_cause(), order=st.randoms(use_true_random=False))
def test_the_rank_that_failed_on_its_own_is_blamed_in_any_order(
    case: tuple[list[RankEnd], int, str], order: object
) -> None:
    ends, culprit, kind = case
    shuffled = list(ends)
    order.shuffle(shuffled)  # type: ignore[attr-defined]
    err = explain(shuffled)
    assert isinstance(err, LaunchError)
    assert err.rank == culprit
    assert err.exitcode == ends[culprit].exitcode
    assert str(err) == str(explain(ends))  # the order the parent saw them in does not matter
    if kind == "signal":
        assert str(err).startswith(
            f"rank {culprit} of {len(ends)} (pid {100 + culprit}) was killed by SIG"
        )


@given(
    n=st.integers(2, 6),
    data=st.data(),
)
def test_a_hung_rank_is_blamed_whoever_timed_out_waiting(n: int, data: st.DataObject) -> None:
    hung = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 1))
    ends = [
        RankEnd(r, 100 + r, -15, False)
        if r in hung
        else RankEnd(r, 100 + r, 1, False, data.draw(st.sampled_from([TIMEOUT, BARRIER, CLOSED])),
                     float(r), float(r) + 0.1)
        for r in range(n)
    ]  # fmt: skip
    err = explain(ends)
    assert isinstance(err, LaunchError)
    assert err.rank == min(hung)
    assert "did not arrive" in str(err).splitlines()[0]
    assert err.exitcode is None
    shuffled = data.draw(st.permutations(ends))
    assert str(explain(shuffled)) == str(err)


def test_rank_end_is_frozen() -> None:
    end = RankEnd(0, 1, 0, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        end.rank = 2  # type: ignore[misc]


STACK = """Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in run

Current thread 0x00007f0000000002 (most recent call first):
  File "/venv/site-packages/torch/distributed/distributed_c10d.py", line 2900 in all_reduce
  File "/home/me/train.py", line 40 in step
  File "/home/me/train.py", line 60 in main
  File "/venv/lib/python3.11/site-packages/cudakit/parallel/launcher.py", line 97 in _child
  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run
"""


def test_a_hung_rank_leads_with_where_it_was_last_seen() -> None:
    ends = [
        RankEnd(0, 100, 1, False, TIMEOUT, raised_at=13.0, ended_at=13.2),
        RankEnd(1, 101, -15, False, stack=STACK),
    ]
    err = explain(ends)
    assert isinstance(err, LaunchError)
    text = str(err)
    assert text.splitlines()[0] == (
        "rank 1 of 2 (pid 101) did not arrive; last seen in: all_reduce "
        "(distributed_c10d.py:2900), called from step (train.py:40). It was still running when "
        "rank 0 gave up waiting for it in a collective, and launch() stopped it."
    )
    assert (
        "Rank 1's Python stack when last seen (most recent call first):\n"
        '  File "/venv/site-packages/torch/distributed/distributed_c10d.py", line 2900 in '
        'all_reduce\n  File "/home/me/train.py", line 40 in step\n'
        '  File "/home/me/train.py", line 60 in main\n\nTraceback from rank 0:'
    ) in text


def test_stack_frames_keep_the_launched_thread_down_to_the_launched_function() -> None:
    assert [f[2] for f in stack_frames(STACK)] == ["all_reduce", "step", "main"]
    assert stack_frames("") == []
    assert last_seen("") == ""


def test_the_launch_timeout_says_where_each_rank_was() -> None:
    ends = [RankEnd(0, 100, -9, False, stack=STACK), RankEnd(1, 101, -9, False)]
    text = str(explain(ends, timed_out=8.0))
    assert text.startswith("launch() timed out after 8s with rank(s) [0, 1] still running")
    assert "\nrank 0 last seen in: all_reduce (distributed_c10d.py:2900), called from " in text


CHAINED = """Traceback (most recent call last):
  File "x.py", line 1 in f
RuntimeError: [../unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation
  second line

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "x.py", line 2 in g
ValueError: the gist
the details
and advice at the end
autocast_step: this failure came inside DDP's synchronised backward of micro-step 1
"""


def test_the_exception_line_is_the_last_exception_and_its_first_line() -> None:
    assert exception_line(CHAINED) == "ValueError: the gist"
    assert exception_line(REAL) == "ValueError: bad batch"
    assert exception_line("") == "an exception"


def test_a_victim_error_annotated_or_re_raised_on_the_way_up_is_still_a_victim() -> None:
    assert is_victim(CHAINED)
    assert is_victim(TIMEOUT + "autocast_step: this failure came inside DDP's backward\n")
    assert not is_victim(REAL + "a note\n")


def _raised(rank: int, when: float, text: bytes) -> RankEnd:
    """A rank that reported ``text`` at ``when`` and exited with code 1."""
    return RankEnd(rank, 10 + rank, 1, False, text.decode(), when, when + 0.1)


def test_launch_error_words_independent_failures() -> None:
    cause = b"Traceback ...\n  raise ValueError\nValueError: bad batch\n"
    other = b"Traceback ...\nKeyError: 'label'\n"
    echo = b"Traceback ...\nRuntimeError: [../gloo/pair.cc:534] Connection closed by peer\n"
    same = explain([_raised(0, 2.0, cause), _raised(1, 1.0, cause)])
    assert same is not None
    assert str(same).startswith(
        "rank 1 of 2 (pid 11) failed: ValueError: bad batch\n"
        "(rank 0 failed too, independently, with the same error)\n\n"
    )
    assert "probably as a consequence" not in str(same)
    different = explain([_raised(0, 1.0, cause), _raised(1, 2.0, other), _raised(2, 3.0, echo)])
    assert str(different).startswith(
        "rank 0 of 3 (pid 10) failed: ValueError: bad batch\n"
        "(also failed, independently: rank 1: KeyError: 'label')\n"
        "(then, probably as a consequence: rank 2: RuntimeError: [../gloo/pair.cc:534] "
        "Connection closed by peer)\n\n"
    )
    three = explain([_raised(0, 1.0, cause), _raised(1, 2.0, cause), _raised(2, 3.0, cause)])
    assert "(ranks 1, 2 failed too, independently, with the same error)" in str(three)
