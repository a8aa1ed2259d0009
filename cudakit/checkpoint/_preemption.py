"""Preemption: a stop signal noted by a handler, then agreed across ranks.

SLURM (``--signal=USR1@90``, or SIGTERM before a preemption), Kubernetes and
torchrun stop a job with a signal. The handler only notes it (and calls the
handler that was installed before, so the user's own keep working). The loop asks
:meth:`StopAgreement.poll` at each window boundary; under a process group every rank
contributes its flags to an all-reduce started asynchronously on a group of its own
and read at the next boundary, so a rank without a signal never waits and no
collective blocks a step. A rank with a signal in hand waits for the round at once,
so when every rank has the signal they all stop at that boundary; otherwise at the
next one, where every rank reads the round (see :class:`StopAgreement`).
``benchmarks/bench_checkpoint.py --stop`` measures the cost per window.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Collection
from types import FrameType
from typing import Any

import torch

from .._check import fail_type, fail_value

__all__ = [
    "DEFAULT_SIGNALS",
    "Preemption",
    "SignalWatch",
    "StopAgreement",
    "after_stop",
    "requeue_slurm_job",
    "requeues_after",
    "stop_signals",
]

log = logging.getLogger("cudakit.checkpoint")

#: SIGTERM (SLURM preemption, Kubernetes, torchrun) and SIGUSR1 (SLURM's ``--signal``).
DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    *((signal.SIGUSR1,) if hasattr(signal, "SIGUSR1") else ()),
)

_Handler = Callable[[int, FrameType | None], Any] | int | None

_UNCATCHABLE = frozenset(
    getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)
)
_SIGNAL_FIX = (
    "Pass True (SIGTERM and SIGUSR1), False, or the signals to watch: a name or a "
    "signal.Signals, or a list, e.g. preemption=['SIGTERM', 'SIGUSR2'] for SLURM's "
    "--signal=USR2@90."
)


def stop_signals(func: str, value: object) -> tuple[signal.Signals, ...]:
    """The signals ``preemption=`` asks to watch: True, False, or signals by name.

    A name may leave out ``SIG`` and is read in any case (``"USR2"``, ``"sigusr2"``); a
    ``signal.Signals`` is taken as it is, a plain number is not (``preemption=1``, meant
    as True, would watch SIGHUP). Each signal is kept once, in the order given. SIGKILL
    and SIGSTOP cannot be caught.
    """
    if isinstance(value, bool):
        return DEFAULT_SIGNALS if value else ()
    items = list(value) if isinstance(value, list | tuple | set | frozenset) else [value]
    if isinstance(value, set | frozenset):
        items.sort(key=lambda item: str(item))
    out: list[signal.Signals] = []
    for item in items:
        if isinstance(item, str):
            name = item.strip().upper()
            name = name if name.startswith("SIG") else "SIG" + name
            found = getattr(signal.Signals, name, None) if name.isidentifier() else None
            if not isinstance(found, signal.Signals):
                fail_value(func, "preemption", "a signal this system knows", item, _SIGNAL_FIX)
            sig = found
        elif isinstance(item, signal.Signals):  # (a plain int is refused: 1 is SIGHUP)
            sig = item
        else:
            fail_type(
                func,
                "preemption",
                "True or False, or signals (names such as 'SIGUSR2', or signal.Signals)",
                item,
                _SIGNAL_FIX,
            )
        if sig in _UNCATCHABLE:
            fail_value(
                func,
                "preemption",
                "signals a process can catch",
                item,
                f"{sig.name} cannot be caught, so nothing can save on it. " + _SIGNAL_FIX,
            )
        if sig not in out:
            out.append(sig)
    return tuple(out)


def requeues_after(sig: int) -> bool:
    """Whether ``requeue="auto"`` requeues after ``sig``: every watched signal but SIGTERM
    and SIGINT (SIGUSR1 by default; SLURM's ``--signal`` sends the one it is given)."""
    return sig not in (signal.SIGTERM, signal.SIGINT)


class SignalWatch:
    """Notes the stop signals; chains the handlers that were there before.

    Installed only from the main thread (Python delivers signals there);
    :meth:`uninstall` puts the previous handlers back. Where it cannot (a handler
    installed on top of this one since, or ``close()`` called from another thread),
    the watch is detached instead: it only forwards each signal to the handler that
    was there before, and gives its place back at the first signal it still receives
    as the installed handler (re-delivering that signal, so that SIGTERM's default
    action still ends the process).
    """

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        #: The first signal noted (None: none yet).
        self.signum: int | None = None
        #: Every signal noted, in the order they first came.
        self.seen: list[int] = []
        self._previous: dict[signal.Signals, _Handler] = {}
        self._detached = False
        if not signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)

    @property
    def installed(self) -> bool:
        return bool(self._previous) and not self._detached

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        previous = _unwrap(sig, self._previous.get(sig))
        if self._detached:
            if signal.getsignal(sig) == self._handle:  # closed, yet still the handler
                signal.signal(sig, _settable(previous))
                if previous is None or previous == signal.SIG_DFL:
                    signal.raise_signal(sig)  # the default action, as without the watch
                    return
            if callable(previous):
                previous(signum, frame)
            return
        again = signum in self.seen
        if self.signum is None:
            self.signum = signum
        if not again:
            self.seen.append(signum)
        # (SIGINT's default handler raises KeyboardInterrupt: the watch takes its place for
        # the first Ctrl-C, the save; a second one interrupts, as without the watch.)
        if callable(previous) and (previous is not signal.default_int_handler or again):
            previous(signum, frame)

    def uninstall(self) -> None:
        """Put the previous handlers back where this watch is still the handler; detach."""
        if self._detached:
            return
        self._detached = True
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal() works in the main thread only: see _handle
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, _settable(_unwrap(sig, previous)))


def _unwrap(sig: signal.Signals, handler: _Handler) -> _Handler:
    """``handler``, or for a detached watch's, the handler that watch forwards to."""
    while True:
        owner = getattr(handler, "__self__", None)
        if not (isinstance(owner, SignalWatch) and owner._detached):
            return handler
        handler = owner._previous.get(sig)


def _settable(handler: _Handler) -> Callable[[int, FrameType | None], Any] | int:
    """A handler ``signal.signal`` accepts: None (not installed from Python) is SIG_DFL."""
    return signal.SIG_DFL if handler is None else handler


class StopAgreement:
    """Whether every rank should stop, agreed at a window boundary.

    Every rank calls :meth:`poll` at the same boundaries. Under a process group each
    call starts one round: an all-reduce (max) of the rank's flags (one per watched
    signal, and one for "no signal here") on a gloo group of its own, asynchronously. A
    round is read at the next boundary, so a rank without a signal never waits for the
    others. A rank with a signal in hand waits for its round at once: when every rank
    had a signal, all stop there; else all stop at the next boundary, where every rank
    reads that round. So a signal that every rank has before a boundary stops them all
    at it, and one that some rank has stops them all one boundary later at the latest.

    What is agreed is the set of stop signals any rank received (:attr:`signals`), so
    that a rank the signal did not reach exits as the others do, and rank 0 requeues
    after a SIGUSR1 that reached another rank first.
    """

    def __init__(
        self, group: Any = None, watched: tuple[signal.Signals, ...] = DEFAULT_SIGNALS
    ) -> None:
        self._group = group
        self._watched = watched
        self._pending: tuple[Any, torch.Tensor] | None = None
        #: The signals any rank received, in the order of ``watched``.
        self.signals: tuple[int, ...] = ()

    @property
    def agreed(self) -> bool:
        """Whether every rank stops (some rank received a stop signal)."""
        return bool(self.signals)

    def _merge(self, received: Collection[int]) -> None:
        known = {*self.signals, *received}
        self.signals = tuple(int(s) for s in self._watched if int(s) in known)

    def _read(self, flags: torch.Tensor) -> bool:
        """Merge a finished round's signals; whether every rank had one (a CPU tensor)."""
        values = flags.tolist()
        self._merge([int(s) for s, f in zip(self._watched, values, strict=False) if f])
        return not values[-1]

    def poll(self, seen: Collection[int]) -> bool:
        """Whether every rank stops here; starts this boundary's round (a collective)."""
        if self._group is None or not self._watched:
            if seen:  # (once per batch: nothing to merge in the common case)
                self._merge(seen)
            return bool(self.signals)
        import torch.distributed as dist

        if self._pending is not None:  # the last boundary's round: every rank reads it
            work, flags = self._pending
            self._pending = None
            work.wait()
            self._read(flags)
            if self.agreed:
                return True
        mine = [int(int(s) in seen) for s in self._watched]
        flags = torch.tensor([*mine, int(not any(mine))], dtype=torch.int32)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, flags)
        if any(mine):  # this rank stops anyway: wait, to stop here if every rank can
            work.wait()
            if self._read(flags):
                self._pending = None
                return True
            self.signals = ()  # (not yet: every rank reads this round at the next boundary)
        return False

    def drain(self) -> None:
        """Finish the round in flight (every rank calls this at the same point)."""
        if self._pending is not None:
            work, _ = self._pending
            self._pending = None
            with contextlib.suppress(RuntimeError):
                work.wait()


#: What SLURM names a job by: digits, or ``<array job>_<task>``.
_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+)?")


def requeue_slurm_job() -> str | None:
    """Ask SLURM to requeue this job (``scontrol requeue``); returns what was done, or why
    it failed, for the log; None outside a SLURM batch job or without ``scontrol``.

    An array task is named ``<array job>_<task>`` (never the whole array). The shell of
    ``salloc`` (``SLURM_JOB_NAME`` ``bash``/``interactive``) has no batch job to
    requeue. A failure (scontrol's status, or scontrol that cannot run) is returned,
    never raised: the run still exits with the status the scheduler expects.
    """
    env = os.environ
    if env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    array, task = env.get("SLURM_ARRAY_JOB_ID", ""), env.get("SLURM_ARRAY_TASK_ID", "")
    job = f"{array}_{task}" if array and task else env.get("SLURM_JOB_ID", "")
    if not job:
        return None
    if not _JOB_ID.fullmatch(job):
        return (
            f"not requeued: the SLURM job id {job!r} is not a job id (digits, or "
            "<array job>_<task>); requeue the job by hand"
        )
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    command = f"scontrol requeue {job}"
    try:
        done = subprocess.run(
            [scontrol, "requeue", job],
            check=False,
            timeout=60,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{command} failed ({type(exc).__name__}: {exc}); requeue the job by hand"
    status = getattr(done, "returncode", 0)
    if status:
        why = (getattr(done, "stderr", "") or getattr(done, "stdout", "") or "").strip()
        return f"{command} failed with status {status}" + (f": {why}" if why else "")
    return command


def after_stop(
    rank: int,
    agreed: tuple[int, ...],
    watch: SignalWatch,
    requeue: bool | str,
    exit_code: int | None,
) -> int:
    """Requeue the SLURM job (rank 0, as ``requeue`` says) after an agreed stop; the status
    to exit with: ``exit_code``, else ``128 +`` the signal.

    The agreed signals count as received: a rank the signal did not reach exits (and rank
    0 requeues) as the rank it reached does; so do signals that came during the save.
    """
    # Every rank the same status: the agreed signals' (SIGTERM's among several).
    signum = watch.signum
    if agreed:
        signum = int(signal.SIGTERM) if int(signal.SIGTERM) in agreed else agreed[0]
    received = {*agreed, *watch.seen}
    wanted = requeue is True or any(requeues_after(s) for s in received)
    if rank == 0 and requeue is not False and wanted:
        done = requeue_slurm_job()
        if done:
            log.warning("cudakit: %s", done)
    if exit_code is not None:
        return exit_code
    return 128 + (signum if signum is not None else int(signal.SIGTERM))


class Preemption:
    """The stop signals this process watches, agreed across ranks, and the exit after.

    The part of a :class:`~cudakit.checkpoint.Checkpointer` that owns its
    :class:`SignalWatch` and :class:`StopAgreement`.
    """

    def __init__(
        self,
        signals: tuple[signal.Signals, ...],
        group: Any,
        requeue: bool | str,
        exit_code: int | None,
    ) -> None:
        self.watch = SignalWatch(signals)
        self.agreement = StopAgreement(group, signals)
        self._requeue = requeue
        self._exit_code = exit_code

    @property
    def requested(self) -> bool:
        """Whether this process received a watched stop signal."""
        return self.watch.signum is not None

    def poll(self) -> bool:
        """Whether every rank stops at this window boundary (see :meth:`StopAgreement.poll`)."""
        return self.agreement.poll(self.watch.seen)

    def exit_status(self, rank: int) -> int:
        """Requeue as asked (rank 0) and return the status to exit with (:func:`after_stop`)."""
        return after_stop(rank, self.agreement.signals, self.watch, self._requeue, self._exit_code)

    def close(self) -> None:
        """Finish the round in flight, and put the signal handlers back."""
        try:
            self.agreement.drain()
        finally:
            self.watch.uninstall()
