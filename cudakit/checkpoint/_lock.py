"""One run per checkpoint directory: a lock a second live run is refused at.

Rank 0 of a run takes an ``fcntl`` lock (a POSIX record lock, which NFS v4 and the
cluster file systems carry between hosts) on ``<directory>/.cudakit-lock`` and writes
who it is into the file: host, pid, start time, SLURM job. The operating system drops
the lock when the process dies, however it dies, so a lock file a killed run left is
no obstacle: only a live holder refuses. Under a SLURM requeue (the same
``SLURM_JOB_ID``), the new job waits up to :data:`REQUEUE_WAIT` seconds for the old
one to let go before it is refused.

Within one process the lock is shared: a second :class:`~cudakit.checkpoint.Checkpointer`
on the same directory (a rollback, a test) belongs to the same run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ..exceptions import CheckpointSaveError

__all__ = ["LOCK_FILE", "REQUEUE_WAIT", "Held", "Holder", "hold", "hold_on_rank0"]

#: The lock file's name in the checkpoint directory.
LOCK_FILE = ".cudakit-lock"
#: Seconds a requeued SLURM job waits for its old self to let go of the directory.
REQUEUE_WAIT = 120.0
_POLL = 0.5


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a directory, as its lock file says."""

    host: str
    pid: int
    started: str
    job: str | None = None

    @classmethod
    def me(cls) -> Holder:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return cls(socket.gethostname(), os.getpid(), now, os.environ.get("SLURM_JOB_ID"))

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            data = json.loads(text)
            return cls(str(data["host"]), int(data["pid"]), str(data["started"]), data.get("job"))
        except (ValueError, KeyError, TypeError):
            return None  # empty (being written) or not ours

    def describe(self) -> str:
        job = f", SLURM job {self.job}" if self.job else ""
        return f"pid {self.pid} on host {self.host}, started {self.started}{job}"


class Held:
    """This process's hold on one directory's lock; :meth:`release` once per hold."""

    def __init__(self, entry: _Entry) -> None:
        self._entry: _Entry | None = entry

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is None:
            return
        entry.count -= 1
        if entry.count == 0 and entry.pid == os.getpid():
            _HELD.pop(entry.path, None)
            with contextlib.suppress(OSError):  # (unlinked while locked: see _try's check)
                os.unlink(entry.path)
            os.close(entry.fd)


@dataclasses.dataclass
class _Entry:
    path: Path
    fd: int
    pid: int
    count: int = 0


_HELD: dict[Path, _Entry] = {}


def hold(root: Path, func: str = "Checkpointer") -> Held:
    """Take (or share, within this process) the lock of directory ``root``.

    Raises:
        CheckpointSaveError: another live process holds it, naming that process and the
            fix (after waiting up to :data:`REQUEUE_WAIT` seconds when it is this SLURM
            job's earlier run).
    """
    path = root.resolve() / LOCK_FILE
    entry = _HELD.get(path)
    if entry is not None and entry.pid != os.getpid():  # inherited through fork(): not ours
        _HELD.pop(path)
        entry = None
    if entry is None:
        entry = _take(path, func)
        _HELD[path] = entry
    entry.count += 1
    return Held(entry)


def hold_on_rank0(root: Path, rank: int, group: Any) -> Held | None:
    """Rank 0 takes ``root``'s lock (:func:`hold`); under a process group (``group``, the
    control group) its verdict is broadcast, so every rank raises the same error."""
    held, refused = None, None
    if rank == 0:
        try:
            held = hold(root)
        except CheckpointSaveError as exc:
            refused = str(exc)
    if group is not None:
        import torch.distributed as dist

        box: list[Any] = [refused]
        dist.broadcast_object_list(box, src=0, group=group)
        refused = box[0]
    if refused is not None:
        raise CheckpointSaveError(refused)
    return held


def _take(path: Path, func: str) -> _Entry:
    deadline: float | None = None
    while True:
        fd, holder = _try(path)
        if fd is not None:
            me = Holder.me()
            text = json.dumps(dataclasses.asdict(me)).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, text, 0)
            return _Entry(path, fd, os.getpid())
        job = os.environ.get("SLURM_JOB_ID")
        if deadline is None:
            requeued = job is not None and holder is not None and holder.job == job
            deadline = time.monotonic() + (REQUEUE_WAIT if requeued else 0.0)
        if time.monotonic() >= deadline:
            raise _refused(path.parent, holder, func)
        time.sleep(_POLL)


def _try(path: Path) -> tuple[int | None, Holder | None]:
    """The locked file's descriptor, else None and who holds it."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = Holder.parse(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
        finally:
            os.close(fd)
        return None, holder
    try:
        same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        same = False
    if not same:  # the holder let go and removed the file as we opened it: again
        os.close(fd)
        return _try(path)
    return fd, None


def _refused(root: Path, holder: Holder | None, func: str) -> CheckpointSaveError:
    who = holder.describe() if holder is not None else "(it has not written its details yet)"
    fix = (
        f"Stop that run first (kill {holder.pid} on {holder.host}), or give this run "
        "another directory."
        if holder is not None
        else "Stop that run first, or give this run another directory."
    )
    wait = (
        f" A requeued SLURM job waits {REQUEUE_WAIT:.0f} s for its old run to let go; it did not."
        if holder is not None and holder.job and holder.job == os.environ.get("SLURM_JOB_ID")
        else ""
    )
    return CheckpointSaveError(
        f"{func}(directory={str(root)!r}): another run is using this directory: {who}. Two "
        f"runs in one directory overwrite each other's checkpoints, and a resume could mix "
        f"their weights.{wait} {fix}"
    )
