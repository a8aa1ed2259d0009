"""Preemption: a stop signal noted by a handler, then agreed across ranks.

SLURM (``--signal=USR1@90``, or SIGTERM before a preemption), Kubernetes and
torchrun stop a job with a signal. The handler only notes it (and calls the
handler that was installed before, so the user's own keep working). The loop asks
:meth:`StopAgreement.poll` at each window boundary; under a process group every rank
contributes its flag to an all-reduce (max) started asynchronously on a group of its
own and read at the next boundary, so every rank sees the same answer at the same
boundary without ever waiting for a rank that did not see the signal, and without a
blocking collective per step.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

__all__ = ["DEFAULT_SIGNALS", "SignalWatch", "StopAgreement", "requeue_slurm_job"]

#: SIGTERM (SLURM preemption, Kubernetes, torchrun) and SIGUSR1 (SLURM's ``--signal``).
DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    *((signal.SIGUSR1,) if hasattr(signal, "SIGUSR1") else ()),
)

_Handler = Callable[[int, FrameType | None], Any] | int | None


class SignalWatch:
    """Notes the first stop signal; chains the handlers that were there before.

    Installed only from the main thread (Python delivers signals there);
    :meth:`uninstall` puts the previous handlers back.
    """

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.signum: int | None = None
        self._previous: dict[signal.Signals, _Handler] = {}
        if not signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous):
            previous(signum, frame)

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


class StopAgreement:
    """Whether every rank should stop, agreed one window boundary after any rank asks."""

    def __init__(self, group: Any = None) -> None:
        self._group = group
        self._pending: tuple[Any, torch.Tensor] | None = None
        self.agreed = False

    def poll(self, local: bool) -> bool:
        """The agreed answer now; starts the next round with this rank's ``local`` flag."""
        if self._group is None:
            self.agreed = self.agreed or local
            return self.agreed
        import torch.distributed as dist

        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            self.agreed = self.agreed or bool(flag[0])  # a CPU tensor: no device sync
        flag = torch.tensor([int(local)], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, flag)
        return self.agreed

    def drain(self) -> None:
        """Finish the round in flight (every rank calls this at the same point)."""
        if self._pending is not None:
            work, _ = self._pending
            self._pending = None
            with contextlib.suppress(RuntimeError):
                work.wait()


def requeue_slurm_job() -> str | None:
    """Ask SLURM to requeue this job (``scontrol requeue``); returns what was done, or None."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    if os.environ.get("SLURM_ARRAY_TASK_ID") and os.environ.get("SLURM_ARRAY_JOB_ID"):
        job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    subprocess.run([scontrol, "requeue", job], check=False, timeout=60)
    return f"scontrol requeue {job}"
