"""``launch()``: run a function in N local processes with torchrun's environment.

The parent holds a ``TCPStore`` on port 0 for a race-free port, starts the ranks
with ``torch.multiprocessing``, collects each rank's result or traceback over a
queue, and turns the first real failure into a :class:`~cudakit.exceptions.LaunchError`.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import time
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import torch.distributed as dist

from .._check import describe
from ..exceptions import LaunchError
from .group import teardown_owned_group

if TYPE_CHECKING:
    from multiprocessing.queues import SimpleQueue

__all__ = ["launch"]

logger = logging.getLogger("cudakit")

R = TypeVar("R")


#: What a child sends back: (rank, ok, wall time, pickled result or traceback text).
_Message = tuple[int, bool, float, bytes]


def _child(
    index: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nprocs: int,
    port: int,
    results: SimpleQueue[_Message],
) -> None:
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
        except Exception:
            # Timestamped, so the parent can name the rank that failed *first* rather than
            # one that failed later because its peer was gone ("Connection closed by peer").
            results.put((index, False, time.time(), traceback.format_exc().encode()))
            raise
        # The result goes out before the teardown: a crash while the process shuts down
        # must not lose what fn returned (the parent then keeps it, with a warning).
        results.put((index, True, time.time(), payload))
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


_ECHOES = (
    b"Connection closed by peer",
    b"Connection reset by peer",
    b"remote worker",
    b"Broken pipe",
    b"ncclRemoteError",
    b"NCCL communicator was aborted",
    b"DistNetworkError",
    b"DistBackendError",
    b"Socket Timeout",
    b"collective operation timeout",
)


def _is_echo(text: bytes) -> bool:
    """Whether a traceback looks like a consequence of another rank's death."""
    lines = text.strip().splitlines()
    return bool(lines) and any(e in lines[-1] for e in _ECHOES)


def _first_failure(
    failures: Mapping[int, tuple[float, bytes]], nprocs: int, pids: list[int]
) -> LaunchError:
    # A rank whose peer died fails too ("Connection closed by peer"), sometimes before the
    # peer's own exception is reported: name the first failure that is not such an echo.
    order = sorted(failures, key=lambda r: (_is_echo(failures[r][1]), failures[r][0]))
    first = order[0]
    text = failures[first][1].decode(errors="replace")

    def last_line(t: str) -> str:
        lines = t.strip().splitlines()
        return lines[-1] if lines else "an exception"

    # The other failures: an echo ("Connection closed by peer") is probably a consequence of
    # the first; a real exception of its own is an independent failure, and said to be.
    echoes = [r for r in order[1:] if _is_echo(failures[r][1])]
    own = [r for r in order[1:] if r not in echoes]
    first_line = last_line(text)

    def listed(ranks: list[int]) -> str:
        return "; ".join(
            f"rank {r}: {last_line(failures[r][1].decode(errors='replace'))}" for r in ranks
        )

    also = ""
    if own:
        lines = {last_line(failures[r][1].decode(errors="replace")) for r in own}
        if lines == {first_line}:
            who = f"rank {own[0]}" if len(own) == 1 else f"ranks {', '.join(map(str, own))}"
            also += f"\n({who} failed too, independently, with the same error)"
        else:
            also += f"\n(also failed, independently: {listed(own)})"
    if echoes:
        also += f"\n(then, probably as a consequence: {listed(echoes)})"
    return LaunchError(
        f"rank {first} of {nprocs} (pid {pids[first]}) failed: {first_line}{also}\n\n"
        f"Traceback from rank {first}:\n{text}",
        rank=first,
        pid=pids[first],
        exitcode=1,
        traceback_text=text,
        pids=pids,
    )


def _exited(
    exc: Any,
    out: Mapping[int, bytes],
    failures: Mapping[int, tuple[float, bytes]],
    nprocs: int,
    pids: list[int],
) -> LaunchError | None:
    """What a rank's death without a Python exception (``ProcessExitedException``) means.

    Called once every process has been stopped and its messages read. Another
    rank's Python exception explains more than a signal, so it wins. If every rank
    had returned its result, the death happened while shutting down (gloo's
    teardown can abort): the results are kept, with a warning, and ``None`` is
    returned. Otherwise the error says whether the rank had returned and which
    ranks were stopped before returning.
    """
    if failures:
        return _first_failure(failures, nprocs, pids)
    index, msg = int(exc.error_index), str(exc.msg)
    if len(out) == nprocs:
        logger.warning(
            "cudakit: launch(): rank %d returned its result, then died while shutting down "
            "(%s); the results are kept",
            index,
            msg,
        )
        return None
    how = (
        "returned its result, then died while shutting down"
        if index in out
        else "died without a Python exception"
    )
    stopped = [i for i in range(nprocs) if i not in out and i != index]
    also = f"; rank(s) {stopped} were stopped before returning" if stopped else ""
    return LaunchError(
        f"rank {index} of {nprocs} (pid {exc.error_pid}) {how} ({msg}){also}. Look for "
        "sys.exit(), os._exit(), a segfault or the OOM killer in its output.",
        rank=index,
        pid=exc.error_pid,
        exitcode=exc.exit_code,
        pids=pids,
    )


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
    ValueError: launch() needs nprocs >= 1 ...

    Each process gets the environment ``torchrun --standalone --nproc-per-node N``
    gives it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``), so ``parallelize()`` or
    ``process_group()`` inside ``fn`` just work. The port is taken race-free: the
    parent binds a ``TCPStore`` on port 0 and keeps it for the launch, exactly as
    torchrun's agent does. Processes start with ``torch.multiprocessing``.

    If a rank raises, the others are terminated (SIGTERM, then SIGKILL), so one
    waiting in a collective for the dead rank cannot hang the launch, and the
    parent raises :class:`LaunchError` with the failing rank's traceback.

    A process group cudakit created inside ``fn`` (``parallelize()`` without a
    ``process_group()`` block) is destroyed when ``fn`` returns, after the ranks
    meet in a barrier. A rank that returned its result and then died while shutting
    down (gloo can abort in its teardown) costs a logged warning, not the results.

    Args:
        fn: a module-level (picklable) function; its return values come back.
        *args: positional arguments for ``fn``; must be picklable.
        nprocs: the number of processes (ranks).
        timeout: seconds after which all ranks are killed and :class:`LaunchError`
            raised; ``None`` waits for as long as they run.
        start_method: ``"spawn"`` (safe with CUDA; the default), ``"forkserver"`` or ``"fork"``.
        **kwargs: keyword arguments for ``fn``.

    Returns:
        ``fn``'s return values, indexed by rank.

    Raises:
        LaunchError: a rank raised or died, or the launch timed out.
        TypeError, ValueError: bad arguments, or ``fn`` or its arguments cannot be pickled.

    .. versionadded:: 0.1
    """
    if not callable(fn):
        raise TypeError(f"launch() expects a function to run, got {type(fn).__name__}.")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int):
        raise TypeError(
            f"launch() needs nprocs, the number of processes, as an int, got "
            f"{type(nprocs).__name__} {nprocs!r}; e.g. nprocs=2."
        )
    if nprocs < 1:
        raise ValueError(
            f"launch() needs nprocs >= 1 (the number of processes), got {nprocs!r}; "
            "e.g. nprocs=torch.cuda.device_count()."
        )
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(
                f"launch() timeout must be a number of seconds or None, got "
                f"{type(timeout).__name__} {timeout!r}; e.g. timeout=600."
            )
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(
                f"launch() timeout must be a positive, finite number of seconds or None, got "
                f"{timeout!r}; e.g. timeout=600, or None to wait for as long as the ranks run."
            )
    if start_method not in ("spawn", "forkserver", "fork"):
        exc_type = ValueError if isinstance(start_method, str) else TypeError
        raise exc_type(
            f"launch(): start_method must be 'spawn', 'forkserver' or 'fork', got "
            f"{describe(start_method)}. Keep the default 'spawn', which is safe with CUDA."
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
    failures: dict[int, tuple[float, bytes]] = {}

    def drain() -> None:
        while not results.empty():
            i, ok, when, payload = results.get()
            if ok:
                out[i] = payload
            else:
                failures[i] = (when, payload)

    import multiprocessing

    started_before = set(multiprocessing.active_children())
    try:
        procs = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _child,
            args=(fn, args, kwargs, nprocs, store.port, results),
            nprocs=nprocs,
            join=False,
            start_method=start_method,
        )
    except Exception as exc:
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
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    try:
        while True:
            try:
                done = procs.join(timeout=0.05, grace_period=1.0)
            except mp.ProcessRaisedException as exc:  # type: ignore[attr-defined]
                drain()
                if not failures:  # raised outside our wrapper (e.g. unpickling fn)
                    text = str(exc).split("terminated with the following error:\n", 1)[-1]
                    failures[exc.error_index] = (0.0, text.encode())
                raise _first_failure(failures, nprocs, procs.pids()) from None
            except mp.ProcessExitedException as exc:  # type: ignore[attr-defined]
                drain()  # join() has stopped and joined every process: all messages are in
                error = _exited(exc, out, failures, nprocs, procs.pids())
                if error is not None:
                    raise error from None
                break
            drain()
            if done:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(
                    f"launch() timed out after {timeout}s with {nprocs} ranks still running; "
                    "all were killed. Look for a rank waiting in a collective for one that "
                    "never arrived, or raise timeout=.",
                    rank=None,
                    pid=None,
                    exitcode=None,
                    pids=procs.pids(),
                )
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
        for p in procs.processes:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        drain()
        results.close()
        del store
    missing = [i for i in range(nprocs) if i not in out]
    if missing:
        raise LaunchError(
            f"rank(s) {missing} exited without returning a result (sys.exit(0) or a "
            "KeyboardInterrupt in the child?).",
            rank=missing[0],
            pid=None,
            exitcode=0,
            pids=procs.pids(),
        )
    return [cast(R, pickle.loads(out[i])) for i in range(nprocs)]
