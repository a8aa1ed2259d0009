"""A stop signal saves at the next window boundary, chains the user's handler, then exits."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType

import pytest
import torch

import cudakit
from cudakit.checkpoint import _preemption as preemption

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_training import make_data


def _loop(tmp_path: Path, signum: int, at: int, accumulate: int) -> tuple[list[int], Path]:
    model = torch.nn.Linear(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cudakit.autocast_step(opt, model=model, dtype=torch.float32, accumulate=accumulate)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=4)
    ckpt = cudakit.Checkpointer(tmp_path, step=step, loader=loader)
    ran: list[int] = []
    try:
        for _ in ckpt.epochs(3):
            for x, y in ckpt.batches():
                if ckpt.position.total == at:
                    os.kill(os.getpid(), signum)
                with step:
                    loss = torch.nn.functional.mse_loss(model(x), y)
                step.backward(loss)
                ran.append(ckpt.position.total)
    finally:
        ckpt.close()
    return ran, tmp_path


def test_sigterm_saves_at_the_window_end_and_exits_143(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        _loop(tmp_path, signal.SIGTERM, at=3, accumulate=2)
    assert info.value.code == 143
    latest = cudakit.find_latest(tmp_path)
    # Batch 3 opened a window; its end (batch 4, step 2) is where the run saved and stopped.
    assert latest is not None
    assert latest.name == "ckpt-0000000002"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back


def test_sigusr1_exits_138_and_requeue_is_tried_only_under_slurm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []
    monkeypatch.setattr(
        "cudakit.checkpoint._preemption.requeue_slurm_job", lambda: asked.append("x") or None
    )
    with pytest.raises(SystemExit) as info:
        _loop(tmp_path, signal.SIGUSR1, at=2, accumulate=1)
    assert info.value.code == 128 + signal.SIGUSR1
    assert asked == ["x"]


def test_requeue_runs_scontrol_for_the_slurm_job(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setattr(preemption.shutil, "which", lambda name: "/usr/bin/scontrol")
    monkeypatch.setattr(preemption.subprocess, "run", lambda cmd, **kwargs: calls.append(list(cmd)))
    assert preemption.requeue_slurm_job() == "scontrol requeue 4242"
    assert calls == [["/usr/bin/scontrol", "requeue", "4242"]]
    monkeypatch.delenv("SLURM_JOB_ID")
    assert preemption.requeue_slurm_job() is None


def test_the_users_own_handler_is_chained_not_replaced(tmp_path: Path) -> None:
    seen: list[int] = []

    def mine(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with pytest.raises(SystemExit):
            _loop(tmp_path, signal.SIGTERM, at=1, accumulate=1)
        assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_chosen_exit_code_and_no_watching(tmp_path: Path) -> None:
    model = torch.nn.Linear(1, 1)
    ckpt = cudakit.Checkpointer(tmp_path, model=model, preemption=False)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ckpt.close()
    watch = cudakit.Checkpointer(tmp_path, model=model, exit_code=0)
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    os.kill(os.getpid(), signal.SIGTERM)
    assert watch.stop_requested
    watch._cursor.position = cudakit.Position(0, 1, 1, 0)  # a batch ran
    with pytest.raises(SystemExit) as info:
        watch.maybe_save()
    assert info.value.code == 0
    assert cudakit.find_latest(tmp_path) is not None
