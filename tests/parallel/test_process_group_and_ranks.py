"""process_group and the rank helpers: arguments checked at the call, the launcher's
variables read, the exit barrier under the group's timeout, and ``main_process_first``
before any group."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch.distributed as dist
from launcher_env import clean_launcher_env, free_port, torchrun_env  # noqa: F401 (autouse fixture)

import cudakit.parallel as cp
from cudakit._dist import (
    current_rank,
    current_world_size,
    launched_local_rank,
    launched_local_world_size,
    launched_rank,
    launched_world_size,
)
from cudakit.exceptions import DeviceError, DistributedSetupError

# --------------------------------------------------------------------------- arguments


def test_process_group_checks_every_argument_at_the_call() -> None:
    with pytest.raises(TypeError, match=r"process_group\(backend=\.\.\.\) expects a string"):
        cp.process_group(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"process_group\(backend=\.\.\.\) expects one of"):
        cp.process_group("carrier-pigeon")
    with pytest.raises(DeviceError, match=r"process_group\(device=\.\.\.\): unknown device"):
        cp.process_group(device="gpu")
    with pytest.raises(TypeError, match=r"process_group\(device=\.\.\.\): device must be"):
        cp.process_group(device=[0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"process_group\(timeout=\.\.\.\) expects seconds"):
        cp.process_group(timeout=[1])  # type: ignore[arg-type]
    assert not dist.is_initialized()


def test_process_group_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DistributedSetupError, match=r"no launcher environment: .*torchrun"):
        cp.process_group().__enter__()
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(DistributedSetupError, match=r"incomplete launcher environment"):
        cp.process_group().__enter__()
    with pytest.raises(ValueError, match=r"finite positive duration, got int -1"):
        cp.process_group(timeout=-1)
    with pytest.raises(ValueError, match=r"finite positive duration, got float inf"):
        cp.process_group(timeout=float("inf"))
    with pytest.raises(TypeError, match=r"timeout=\.\.\.\) expects seconds .* got str '10'"):
        cp.process_group(timeout="10")  # type: ignore[arg-type]


def test_process_group_refuses_nccl_for_a_cpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    for k, v in torchrun_env(1, 0, free_port()).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)  # as on a CUDA build
    with pytest.raises(
        ValueError,
        match=r"process_group\(backend=\.\.\.\): 'nccl' gives the device cpu no backend",
    ):
        cp.process_group("nccl", device="cpu").__enter__()
    assert not dist.is_initialized()


def test_rank_helpers_check_their_arguments() -> None:
    with pytest.raises(TypeError, match=r"is_main_process\(local=\.\.\.\) expects True or False"):
        cp.is_main_process(local="no")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"main_process_first\(local=\.\.\.\) expects True or False"
    ):
        cp.main_process_first(local="no")  # type: ignore[arg-type]


# ------------------------------------------------------------ the launcher's variables


def test_dist_reads_the_launcher_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (launched_rank(), launched_world_size(), launched_local_rank()) == (0, 1, 0)
    assert launched_local_world_size() == 1
    assert (current_rank(), current_world_size()) == (0, 1)
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert (launched_rank(env), launched_world_size(env), launched_local_rank(env)) == (3, 4, 1)
    assert launched_local_world_size(env) == 2
    assert launched_local_world_size({"SLURM_NTASKS_PER_NODE": "8"}) == 8
    bad = {"RANK": "x", "WORLD_SIZE": "0", "LOCAL_RANK": "", "LOCAL_WORLD_SIZE": "-1"}
    assert (launched_rank(bad), launched_world_size(bad), launched_local_rank(bad)) == (0, 1, 0)
    assert launched_local_world_size(bad) == 1
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert (current_rank(), current_world_size(), cp.rank(), cp.world_size()) == (2, 3, 2, 3)


# -------------------------------------------------------------------- the exit barrier


def test_exit_barrier_waits_under_the_groups_timeout(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(
        dist,
        "monitored_barrier",
        lambda group=None, timeout=None, wait_all_ranks=False: seen.append(timeout),
    )
    with cp.process_group(timeout=7):
        pass
    assert seen == [datetime.timedelta(seconds=7)]


def _slow_rank_one(delay: float) -> float:
    with cp.process_group(timeout=2):
        if cp.rank() == 1:
            time.sleep(delay)
        done = time.monotonic()
    return time.monotonic() - done


def test_a_rank_that_never_reaches_the_exit_is_given_up_on_after_the_timeout() -> None:
    waited_0, _ = cp.launch(_slow_rank_one, 8.0, nprocs=2, timeout=60)
    assert waited_0 < 6.0  # the group's 2 s, not torch's default 30 minutes


# ------------------------------------------------- main_process_first before any group


def test_main_process_first_warns_when_launched_ranks_have_no_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    ran = []
    warned = pytest.warns(RuntimeWarning, match=r"no process group is running yet.*process_group")
    with warned, cp.main_process_first():
        ran.append(True)
    assert ran == [True]


def test_main_process_first_is_quiet_in_one_process() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block = cp.main_process_first()
        block.__enter__()
        block.__exit__(None, None, None)
