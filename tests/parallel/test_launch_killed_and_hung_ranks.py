"""``launch(nprocs=2)`` with one rank SIGKILLed or hung: the ``LaunchError`` names that rank
and how it ended, not the surviving rank that saw "Connection reset by peer" or timed out
waiting for it. Finite timeouts everywhere; no process outlives a test."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import cudakit.parallel as cp

pytestmark = pytest.mark.distributed


def _kill_one_mid_training(victim: int) -> None:
    """Both ranks all-reduce in a loop; ``victim`` SIGKILLs itself at step 20."""
    with cp.process_group(timeout=30):
        for step in range(100_000):
            if cp.rank() == victim and step == 20:
                os.kill(os.getpid(), signal.SIGKILL)
            t = torch.ones(4)
            dist.all_reduce(t)


def _hang_on_rank_1() -> None:
    """Rank 1 never reaches the second collective; rank 0's times out after 3 s."""
    with cp.process_group(timeout=3):
        t = torch.ones(1)
        dist.all_reduce(t)
        if cp.rank() == 1:
            time.sleep(120)
        dist.all_reduce(t)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("victim", [1, 0])
def test_the_rank_killed_by_sigkill_is_named(victim: int) -> None:
    start = time.monotonic()
    with pytest.raises(cp.LaunchError) as info:
        cp.launch(_kill_one_mid_training, victim, nprocs=2, timeout=120)
    assert time.monotonic() - start < 90  # two torch imports on a busy machine, never the 120 s
    err = info.value
    first_line = str(err).splitlines()[0]
    assert first_line.startswith(
        f"rank {victim} of 2 (pid {err.pids[victim]}) was killed by SIGKILL (exit code -9) "
        "without a Python exception"
    )
    assert "Connection" not in first_line
    assert (err.rank, err.exitcode, err.pid) == (victim, -9, err.pids[victim])
    assert all(_gone(pid) for pid in err.pids)
    assert multiprocessing.active_children() == []


def test_a_hung_rank_ended_by_the_group_timeout_is_named() -> None:
    start = time.monotonic()
    with pytest.raises(cp.LaunchError) as info:
        cp.launch(_hang_on_rank_1, nprocs=2, timeout=120)
    assert time.monotonic() - start < 90  # the 3 s group timeout, not the 120 s sleep
    err = info.value
    assert str(err).startswith(f"rank 1 of 2 (pid {err.pids[1]}) did not arrive; last seen in: ")
    assert "(then, as a consequence: rank 0: " in str(err)
    assert "launch() stopped it" in str(err)
    assert (err.rank, err.exitcode) == (1, None)
    assert all(_gone(pid) for pid in err.pids)
    assert multiprocessing.active_children() == []
