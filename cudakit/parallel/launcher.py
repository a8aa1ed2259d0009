"""``launch()``: run a function in N local processes with torchrun's environment.

The parent holds a ``TCPStore`` on port 0 for a race-free port, starts the ranks
with ``torch.multiprocessing``, collects each rank's result or traceback over a
queue and watches every process end (exit code or signal, when), and lets
:func:`~cudakit.parallel._failures.explain` turn that into a
:class:`~cudakit.exceptions.LaunchError` that names the cause, not its victims.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import torch.distributed as dist

from .._check import check_callable, check_choice, check_int, check_number
from ._failures import RankEnd, explain, shutdown_notes
from ._unused import unused_parameters_hint
from .group import teardown_owned_group

if TYPE_CHECKING:
    from multiprocessing.queues import SimpleQueue

__all__ = ["launch"]

logger = logging.getLogger("cudakit")

R = TypeVar("R")


#: What a child sends back: (rank, ok, wall time, pickled result or traceback text,
#: what cudakit knows of the failure).
_Message = tuple[int, bool, float, bytes, str]

#: The signal on which a rank dumps its Python stack (faulthandler) for the parent: a
#: real-time signal nobody's training code handles; None where there is none.
_DUMP_SIGNAL: int | None = (
    int(signal.SIGRTMIN) + 4
    if hasattr(signal, "SIGRTMIN") and hasattr(faulthandler, "register")
    else None
)


def _dump_stack_on_signal(path: str) -> Any:
    """Make this rank write its threads' stacks to ``path`` on ``_DUMP_SIGNAL``."""
    if _DUMP_SIGNAL is None:
        return None
    try:
        out = open(path, "w")  # noqa: SIM115  # kept open for the process's life
        faulthandler.register(_DUMP_SIGNAL, file=out, all_threads=True, chain=False)
        open(path + ".ready", "w").close()  # the parent signals only a rank that listens
    except (OSError, ValueError, RuntimeError):  # no room, no signal: the error says less
        return None
    return out


def _child(
    index: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nprocs: int,
    port: int,
    results: SimpleQueue[_Message],
    stacks: str,
) -> None:
    dump = _dump_stack_on_signal(os.path.join(stacks, f"{index}.stack"))  # noqa: F841
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(index),
        LOCAL_RANK=str(index),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
        ROLE_RANK=str(index),
        ROLE_WORLD_SIZE=str(nprocs),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the parent holds the store (and the port)
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID="cudakit-launch",
    )
    clean = False
    try:
        try:
            out = fn(*args, **kwargs)
            try:
                payload = pickle.dumps(out)
            except Exception as exc:
                raise TypeError(
                    f"launch(): rank {index}'s return value of type {type(out).__name__} cannot "
                    f"be pickled back to the parent ({exc}); return plain data (tensors, "
                    "numbers, dicts)."
                ) from exc
        except Exception as exc:
            # Timestamped, so the parent can name the rank that failed *first* rather than
            # one that failed later because its peer was gone ("Connection closed by peer").
            hint = unused_parameters_hint(str(exc))
            notes = getattr(exc, "__notes__", None)
            if hint and notes and hint in notes:
                notes.remove(hint)  # (autocast_step noted it: said once, in the first lines)
            results.put((index, False, time.time(), traceback.format_exc().encode(), hint))
            raise
        # The result goes out before the teardown: a crash while the process shuts down
        # must not lose what fn returned (the parent then keeps it, with a warning).
        results.put((index, True, time.time(), payload, ""))
        clean = True
    finally:
        # A group cudakit created (parallelize() inside fn); the user's own group is theirs
        # to destroy. After a clean return the ranks meet in a barrier first.
        teardown_owned_group(sync=clean)


def _picklable(obj: object) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


#: After the first rank fails, how long the others get to end on their own (and report
#: what they saw) before launch() stops them.
_GRACE_S = 1.0


def _stop(processes: list[Any]) -> None:
    """SIGTERM every live process, then SIGKILL those still alive after 5 s; reap all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _error_file_traceback(path: str | None) -> str:
    """The traceback torch's spawn wrapper wrote for a rank (an exception raised outside
    cudakit's own reporting), ``""`` when there is none; the file is removed."""
    if not path or not os.path.exists(path):
        return ""
    try:
        with open(path, "rb") as fh:
            text = pickle.load(fh)
    except Exception:
        text = ""
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
    return text if isinstance(text, str) else ""


def launch(
    fn: Callable[..., R],
    *args: Any,
    nprocs: int,
    timeout: float | None = None,
    start_method: Literal["spawn", "forkserver", "fork"] = "spawn",
    **kwargs: Any,
) -> list[R]:
    """Run ``fn(*args, **kwargs)`` in ``nprocs`` local processes, as ``torchrun`` would.

    >>> import cudakit.parallel as cp
    >>> cp.launch(print, nprocs=0)
    Traceback (most recent call last):
    ...
    ValueError: launch(nprocs=...) expects an int >= 1, got int 0. ...

    Each process gets the environment ``torchrun --standalone --nproc-per-node N``
    gives it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``), so ``parallelize()`` or
    ``process_group()`` inside ``fn`` just work. The port is taken race-free: the
    parent binds a ``TCPStore`` on port 0 and keeps it for the launch, exactly as
    torchrun's agent does. Processes start with ``torch.multiprocessing``.

    If a rank fails, the others get a second to end on their own, then are
    terminated (SIGTERM, then SIGKILL), so one waiting in a collective for the dead
    rank cannot hang the launch, and the parent raises
    :class:`~cudakit.exceptions.LaunchError`. It names the rank that caused the
    failure and how, from how every rank ended
    (``cudakit.parallel._failures``): the first rank that raised an exception of its
    own or died without one (a signal, an exit code), else a rank that hung while its
    peers' collectives timed out waiting for it; a rank that only saw its peer vanish
    ("Connection reset by peer") is listed as a consequence, never blamed.

    A process group cudakit created inside ``fn`` (``parallelize()`` without a
    ``process_group()`` block) is destroyed when ``fn`` returns, after the ranks
    meet in a barrier. A rank that returned its result and then died while shutting
    down (gloo can abort in its teardown) costs a logged warning, not the results.

    Args:
        fn: a module-level (picklable) function; its return values come back.
        *args: positional arguments for ``fn``; must be picklable.
        nprocs: the number of processes (ranks).
        timeout: seconds after which all ranks are killed and a
            :class:`~cudakit.exceptions.LaunchError` raised; ``None`` waits for as long
            as they run.
        start_method: ``"spawn"`` (safe with CUDA; the default), ``"forkserver"`` or ``"fork"``.
        **kwargs: keyword arguments for ``fn``.

    Returns:
        ``fn``'s return values, indexed by rank.

    Raises:
        LaunchError: a rank raised or died, or the launch timed out.
        TypeError, ValueError: bad arguments, or ``fn`` or its arguments cannot be pickled.

    .. versionadded:: 0.1
    """
    check_callable(
        "launch",
        "fn",
        fn,
        expected="a function to run",
        fix="Pass a function defined at module level, e.g. launch(train, nprocs=2).",
    )
    nprocs = check_int(
        "launch",
        "nprocs",
        nprocs,
        minimum=1,
        fix="It counts the processes: e.g. nprocs=2, or nprocs=torch.cuda.device_count().",
    )  # a NumPy int too
    if timeout is not None:
        timeout = check_number(
            "launch",
            "timeout",
            timeout,
            positive=True,
            expected="a positive finite number of seconds, or None",
            fix="It counts seconds: e.g. timeout=600, or None to wait for as long as the "
            "ranks run.",
        )
    check_choice(
        "launch",
        "start_method",
        start_method,
        ("spawn", "forkserver", "fork"),
        fix="Keep the default 'spawn', which is safe with CUDA.",
    )
    if start_method != "fork":
        try:
            pickle.dumps(fn)
        except Exception as exc:
            raise TypeError(
                f"launch() must send {getattr(fn, '__qualname__', fn)!r} to new processes, but it "
                f"cannot be pickled ({exc}). Define it at module level (not a lambda or a "
                "nested function), or use start_method='fork'."
            ) from None

    import torch.multiprocessing as mp

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False
    )
    ctx = mp.get_context(start_method)
    results: SimpleQueue[_Message] = ctx.SimpleQueue()
    out: dict[int, bytes] = {}
    failures: dict[int, tuple[float, bytes, str]] = {}

    def drain() -> None:
        while not results.empty():
            i, ok, when, payload, hint = results.get()
            if ok:
                out[i] = payload
            else:
                failures[i] = (when, payload, hint)

    import multiprocessing

    started_before = set(multiprocessing.active_children())
    stacks_dir = tempfile.mkdtemp(prefix="cudakit-launch-")
    try:
        procs = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _child,
            args=(fn, args, kwargs, nprocs, store.port, results, stacks_dir),
            nprocs=nprocs,
            join=False,
            start_method=start_method,
        )
    except Exception as exc:
        shutil.rmtree(stacks_dir, ignore_errors=True)
        # Ranks started before the failure (say rank 1 hit a resource limit) would wait
        # for the missing rank until the timeout: stop them, so nothing outlives the launch.
        for p in set(multiprocessing.active_children()) - started_before:
            p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        if start_method != "fork" and not _picklable((args, kwargs)):
            raise TypeError(
                f"launch() must send fn's arguments to new processes, but they cannot be "
                f"pickled ({exc}). Pass plain data (tensors, numbers, paths) and build "
                "locks, open files or connections inside fn, or use start_method='fork'."
            ) from None
        raise
    assert procs is not None  # join=False returns the context
    processes: list[Any] = list(procs.processes)
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    ended: dict[int, float] = {}  # rank -> when the parent saw it end on its own
    timed_out = False
    stacks: dict[int, str] = {}
    try:
        timed_out = _watch(processes, ended, drain, out, deadline)
        stacks = _last_stacks(processes, ended, stacks_dir)
    finally:
        # Whatever happened (a failure, the timeout, Ctrl-C in the parent): nothing
        # outlives the launch. A rank that ended unseen still counts as ended on its own.
        for i, p in enumerate(processes):
            if i not in ended and not p.is_alive():
                ended[i] = time.time()
        _stop(processes)
        drain()
        results.close()
        del store
        shutil.rmtree(stacks_dir, ignore_errors=True)
    ends = []
    for i, p in enumerate(processes):
        when, text, hint = failures.get(i, (None, b"", ""))
        traceback_text = text.decode(errors="replace")
        if not traceback_text and p.exitcode not in (0, None) and i not in out:
            traceback_text = _error_file_traceback(procs.error_files[i])  # raised outside ours
            when = ended.get(i)
        else:
            _error_file_traceback(procs.error_files[i])  # torch leaves them behind
        ends.append(
            RankEnd(
                rank=i,
                pid=int(p.pid),
                exitcode=p.exitcode,
                returned=i in out,
                traceback=traceback_text,
                raised_at=when,
                ended_at=ended.get(i),
                stack=stacks.get(i, ""),
                hint=hint,
            )
        )
    error = explain(ends, timed_out=float(timeout) if timed_out and timeout else None)
    if error is not None:
        raise error
    for note in shutdown_notes(ends):
        logger.warning("cudakit: launch(): %s", note)
    return [cast(R, pickle.loads(out[i])) for i in range(nprocs)]


def _last_stacks(processes: list[Any], ended: Mapping[int, float], where: str) -> dict[int, str]:
    """The Python stacks of the ranks still running, which launch() is about to stop.

    Each rank that listens (its ``.stack.ready`` file) dumps its stack (faulthandler) to its
    own file on ``_DUMP_SIGNAL``; the handler writes it at once, even in a collective.
    """
    live = [
        i
        for i, p in enumerate(processes)
        if i not in ended and p.is_alive() and os.path.exists(f"{where}/{i}.stack.ready")
    ]
    if _DUMP_SIGNAL is None or not live:
        return {}
    for i in live:  # (a rank still starting up is not listening yet: it gets no signal)
        with contextlib.suppress(OSError):
            os.kill(processes[i].pid, _DUMP_SIGNAL)
    stacks: dict[int, str] = {}
    sizes: dict[int, int] = {}
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and len(stacks) < len(live):
        time.sleep(0.05)
        for i in live:
            path = os.path.join(where, f"{i}.stack")
            size = os.path.getsize(path) if os.path.exists(path) else 0
            if size and sizes.get(i) == size:  # written, and no longer growing
                with open(path, errors="replace") as fh:
                    stacks[i] = fh.read()
            sizes[i] = size
    return stacks


def _watch(
    processes: list[Any],
    ended: dict[int, float],
    drain: Callable[[], None],
    out: Mapping[int, bytes],
    deadline: float | None,
) -> bool:
    """Wait for the ranks, recording when each ends on its own; True if the launch timed out.

    Returns once every rank has ended, or ``_GRACE_S`` after the first failure (a rank
    that ended with an exit code other than 0, or without its result), so the others
    can end on their own and report what they saw before they are stopped.
    """
    import multiprocessing.connection

    failed_at: float | None = None
    while len(ended) < len(processes):
        live = {p.sentinel: i for i, p in enumerate(processes) if i not in ended}
        ready = multiprocessing.connection.wait(list(live), timeout=0.05)
        now = time.time()
        for sentinel in ready:
            index = live[sentinel]
            processes[index].join()
            ended[index] = now
        drain()
        if failed_at is None and any(processes[i].exitcode != 0 or i not in out for i in ended):
            failed_at = time.monotonic()
        if failed_at is not None:
            if time.monotonic() - failed_at > _GRACE_S:
                return False
        elif deadline is not None and time.monotonic() > deadline:
            return True
    return False
