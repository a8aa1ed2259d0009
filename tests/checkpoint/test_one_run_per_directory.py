"""One run per checkpoint directory.

A second live process that opens a directory another run uses is refused at once,
with the other run's host, pid and start time and the fix; a lock left by a killed
process is no obstacle; within one process a second Checkpointer shares the lock;
under a SLURM requeue (the same job id) the new run waits for the old one to let go.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import cudakit
from cudakit.checkpoint import _lock as lock

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def _parts() -> dict[str, object]:
    model = torch.nn.Linear(2, 1)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


@contextlib.contextmanager
def _holder(directory: Path, job: str | None = None, close_after: float | None = None
            ) -> Iterator[subprocess.Popen[str]]:  # fmt: skip
    """Another process with a Checkpointer open on ``directory`` (closed after
    ``close_after`` seconds, else held until it is killed)."""
    code = textwrap.dedent(f"""
        import sys, time, torch, cudakit
        model = torch.nn.Linear(2, 1)
        ckpt = cudakit.Checkpointer({str(directory)!r}, model=model, preemption=False)
        print("ready", flush=True)
        if {close_after!r} is not None:
            time.sleep({close_after!r})
            ckpt.close()
            print("closed", flush=True)
        time.sleep(120)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if job is not None:
        env["SLURM_JOB_ID"] = job
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


class _NoWait:
    """Stands for the lock module's ``time``: a refusal that waits fails the test."""

    monotonic = staticmethod(time.monotonic)

    @staticmethod
    def sleep(seconds: float) -> None:
        raise AssertionError(f"the lock waited ({seconds} s) instead of refusing at once")


def test_a_second_live_run_is_refused_at_once_naming_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lock, "time", _NoWait)
    with _holder(tmp_path) as other, pytest.raises(cudakit.CheckpointSaveError) as info:
        cudakit.Checkpointer(tmp_path, **_parts(), preemption=False)
    message = str(info.value)
    assert f"pid {other.pid} on host {socket.gethostname()}, started " in message
    assert "another run is using this directory" in message
    assert f"Stop that run first (kill {other.pid} on {socket.gethostname()})" in message
    assert "another directory" in message


def test_a_lock_left_by_a_killed_run_is_no_obstacle(tmp_path: Path) -> None:
    with _holder(tmp_path) as other:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait(timeout=30)
        assert (tmp_path / lock.LOCK_FILE).exists()  # what the killed run left
        with cudakit.Checkpointer(tmp_path, **_parts(), preemption=False) as ckpt:
            assert ckpt.save() is not None


def test_a_run_that_closed_lets_the_next_one_in(tmp_path: Path) -> None:
    with _holder(tmp_path, close_after=0.0) as other:
        assert other.stdout is not None
        assert other.stdout.readline().strip() == "closed"
        cudakit.Checkpointer(tmp_path, **_parts(), preemption=False).close()
    assert not (tmp_path / lock.LOCK_FILE).exists()  # removed by the last to close


def test_checkpointers_of_one_process_share_the_lock(tmp_path: Path) -> None:
    first = cudakit.Checkpointer(tmp_path, **_parts(), preemption=False)
    second = cudakit.Checkpointer(tmp_path / ".", **_parts(), preemption=False)
    first.close()
    assert (tmp_path / lock.LOCK_FILE).exists()  # the second still holds it
    second.close()
    assert not (tmp_path / lock.LOCK_FILE).exists()


def test_a_requeued_slurm_job_waits_for_its_old_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setattr(lock, "REQUEUE_WAIT", 60.0)
    with _holder(tmp_path, job="4242", close_after=2.0):
        cudakit.Checkpointer(tmp_path, **_parts(), preemption=False).close()  # waited


def test_a_requeued_slurm_job_is_refused_after_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setattr(lock, "REQUEUE_WAIT", 1.0)
    with _holder(tmp_path, job="4242"), pytest.raises(cudakit.CheckpointSaveError) as info:
        cudakit.Checkpointer(tmp_path, **_parts(), preemption=False)
    assert "SLURM job 4242" in str(info.value)
    assert "waits 1 s for its old run" in str(info.value)


def test_another_slurm_job_is_refused_without_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setattr(lock, "time", _NoWait)
    with _holder(tmp_path, job="2"), pytest.raises(cudakit.CheckpointSaveError, match="job 2"):
        cudakit.Checkpointer(tmp_path, **_parts(), preemption=False)
