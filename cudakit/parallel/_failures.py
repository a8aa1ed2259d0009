"""Which rank a failed :func:`~cudakit.parallel.launch` blames, and how it says so. Pure.

When one rank dies, the others usually fail after it: a rank waiting in a collective
gets "Connection reset by peer" when its peer is SIGKILLed, or times out when its peer
hangs. Those ranks are victims, not the cause. The parent records how every rank
ended (:class:`RankEnd`: its exit code or signal, whether it returned its result,
the exception it reported, whether it ended on its own or ``launch()`` stopped it),
and :func:`explain` names the cause, whatever order the ranks ended in:

1. the earliest rank that raised an exception of its own (not a victim's collective
   error), or died without one (a signal, an exit code, ``sys.exit(0)`` before
   returning; or a death while shutting down that cost another rank its result);
2. else the rank(s) still running when their peers' collectives gave up waiting for
   them: they hung, and ``launch()`` stopped them;
3. else the earliest victim (every rank failed in a collective, none hung).

The other ranks are listed after the cause: independent failures, victims, ranks
``launch()`` stopped.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import signal
import sysconfig
from collections.abc import Sequence

from ..exceptions import LaunchError

__all__ = [
    "RankEnd",
    "describe_exit",
    "exception_line",
    "explain",
    "is_victim",
    "last_seen",
    "shutdown_notes",
    "stack_frames",
]


@dataclasses.dataclass(frozen=True)
class RankEnd:
    """How one rank of a launch ended, as the parent saw it."""

    rank: int
    pid: int
    exitcode: int | None  # negative: killed by that signal; None: never reaped
    returned: bool  # its result came back to the parent
    traceback: str = ""  # the exception it reported; "" when it reported none
    raised_at: float | None = None  # when it reported it (time.time())
    ended_at: float | None = None  # when the parent saw it end on its own; None: stopped
    stack: str = ""  # its Python stack (faulthandler's dump) when launch() stopped it
    hint: str = ""  # what cudakit knows of the failure (unused parameters, by name)


#: The last lines of a rank that failed because a peer died, hung or left: a victim.
_VICTIM_MARKS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Connection refused",
    "remote worker",
    "Broken pipe",
    "ncclRemoteError",
    "NCCL communicator was aborted",
    "DistNetworkError",
    "DistBackendError",
    "Socket Timeout",
    "collective operation timeout",
    "Timed out waiting",
    "failed to pass monitoredBarrier",
    "wait timeout after",
)


_CHAIN_LINES = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)


def _exception_lines(text: str) -> list[str]:
    """The lines of a traceback that are no frame: each exception's message and notes."""
    return [
        line
        for line in text.strip().splitlines()
        if line.strip() and not line[0].isspace() and not _chain(line)
    ]


def _chain(line: str) -> bool:
    """A traceback's own line: its start, or the words between chained exceptions."""
    return line.startswith("Traceback ") or line in _CHAIN_LINES


def exception_line(text: str) -> str:
    """The last exception's type and the first line of its message (``"ValueError: bad"``).

    Torch's long messages end with advice, and notes come after the message: the gist
    is the first line after the last traceback's frames.
    """
    lines = text.strip().splitlines()
    start = max((i for i, line in enumerate(lines) if _chain(line)), default=-1)
    head = next((ln for ln in lines[start + 1 :] if ln.strip() and not ln[0].isspace()), None)
    return head or (lines[-1] if lines else "an exception")


def is_victim(traceback: str) -> bool:
    """Whether a traceback is a collective failing because a peer died, hung or left.

    Any exception of the chain counts, and any line of its message or notes: an error
    re-raised or annotated on the way up (``autocast_step``'s note) is still a victim's.
    """
    return any(mark in line for line in _exception_lines(traceback) for mark in _VICTIM_MARKS)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit(exitcode: int | None) -> str:
    """``"was killed by SIGKILL (exit code -9)"``, ``"exited with code 3"``, ..."""
    if exitcode is None:
        return "was still running"
    if exitcode < 0:
        return f"was killed by {_signal_name(-exitcode)} (exit code {exitcode})"
    return f"exited with code {exitcode}"


def _how(exitcode: int | None) -> str:
    """``"killed by SIGABRT, exit code -6"``, ``"exit code 3"``: for inside parentheses."""
    if exitcode is not None and exitcode < 0:
        return f"killed by {_signal_name(-exitcode)}, exit code {exitcode}"
    return f"exit code {exitcode}"


def shutdown_notes(ends: Sequence[RankEnd]) -> list[str]:
    """One line per rank that returned its result, then died while shutting down."""
    return [
        f"rank {e.rank} returned its result, then died while shutting down ({_how(e.exitcode)}); "
        "the results are kept"
        for e in sorted(ends, key=lambda e: e.rank)
        if e.returned and e.exitcode not in (0, None)
    ]


def _look_for(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = _signal_name(-exitcode)
        if name == "SIGKILL":
            return (
                "the OOM killer (`dmesg`, the job's memory limit), a scheduler or someone "
                "running `kill -9`"
            )
        if name in ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL"):
            return "a crash in native code (a segfault or an abort) in its output"
        return f"whoever sent {name}"
    return "sys.exit() or os._exit() in its code or its output"


def _dead(end: RankEnd) -> bool:
    """Ended on its own, without a Python exception, in a way that counts as failing."""
    return (
        end.ended_at is not None and not end.traceback and (end.exitcode != 0 or not end.returned)
    )


def _cause_line(end: RankEnd, n: int) -> str:
    head = f"rank {end.rank} of {n} (pid {end.pid})"
    if end.traceback:
        hint = f"\n{end.hint}" if end.hint else ""
        return f"{head} failed: {exception_line(end.traceback)}{hint}"
    if end.returned:
        return (
            f"{head} returned its result, then died while shutting down ({_how(end.exitcode)}). "
            f"Look for {_look_for(end.exitcode)}"
        )
    if end.exitcode == 0:
        return (
            f"{head} exited with code 0 without returning a result (sys.exit(0) or a "
            "KeyboardInterrupt in the child?)"
        )
    return (
        f"{head} {describe_exit(end.exitcode)} without a Python exception, before returning "
        f"its result. Look for {_look_for(end.exitcode)}"
    )


def _others(cause: RankEnd, ends: Sequence[RankEnd], hung: Sequence[RankEnd]) -> str:
    """The lines about every rank but the cause: independent, victims, deaths, stopped."""
    first = exception_line(cause.traceback) if cause.traceback else None
    own = [e for e in ends if e is not cause and e.traceback and not is_victim(e.traceback)]
    victims = [e for e in ends if e is not cause and e.traceback and is_victim(e.traceback)]
    deaths = [e for e in ends if e is not cause and _dead(e)]
    stopped = [
        e
        for e in ends
        if e is not cause
        and e not in hung
        and e.ended_at is None
        and not e.returned
        and not e.traceback
    ]
    out = ""
    if own:
        if {exception_line(e.traceback) for e in own} == {first}:
            who = (
                f"rank {own[0].rank}"
                if len(own) == 1
                else f"ranks {', '.join(str(e.rank) for e in own)}"
            )
            out += f"\n({who} failed too, independently, with the same error)"
        else:
            listed = "; ".join(f"rank {e.rank}: {exception_line(e.traceback)}" for e in own)
            out += f"\n(also failed, independently: {listed})"
    if deaths:
        listed = "; ".join(f"rank {e.rank} {describe_exit(e.exitcode)}" for e in deaths)
        out += f"\n(also: {listed})"
    if victims:
        listed = "; ".join(f"rank {e.rank}: {exception_line(e.traceback)}" for e in victims)
        out += f"\n(then, probably as a consequence: {listed})"
    if stopped:
        ranks = ", ".join(str(e.rank) for e in stopped)
        out += f"\n(launch() then stopped the ranks still running: {ranks})"
    return out


_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.+)$')
_CUDAKIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB = sysconfig.get_paths()["stdlib"]

#: A frame of a faulthandler dump: (file, line, function).
Frame = tuple[str, int, str]


def _launched(frame: Frame) -> bool:
    return frame[2] == "_child" and frame[0].endswith("launcher.py")


def stack_frames(stack: str) -> list[Frame]:
    """The launched function's frames in a faulthandler dump, most recent call first.

    The thread that runs the launched function (``launch()``'s ``_child`` below it), cut
    there; else the first thread.
    """
    threads: list[list[Frame]] = []
    for line in stack.splitlines():
        if "most recent call first" in line:
            threads.append([])
        elif threads and (m := _FRAME.match(line)):
            threads[-1].append((m["file"], int(m["line"]), m["func"].strip()))
    thread = next((t for t in threads if any(map(_launched, t))), threads[0] if threads else [])
    return list(itertools.takewhile(lambda f: not _launched(f), thread))


def _library(path: str) -> bool:
    return "-packages" + os.sep in path or path.startswith(
        ("<", _CUDAKIT + os.sep, _STDLIB + os.sep)
    )


def _at(frame: Frame) -> str:
    return f"{frame[2]} ({os.path.basename(frame[0])}:{frame[1]})"


def last_seen(stack: str) -> str:
    """Where a rank was: ``"step (train.py:40)"``; inside a library, the caller of yours too."""
    frames = stack_frames(stack)
    if not frames:
        return ""
    where = _at(frames[0])
    yours = next((f for f in frames if not _library(f[0])), None)
    if yours is not None and yours is not frames[0]:
        where += f", called from {_at(yours)}"
    return where


def _stack_text(end: RankEnd) -> str:
    frames = stack_frames(end.stack)
    if not frames:
        return ""
    lines = "\n".join(f'  File "{file}", line {line} in {func}' for file, line, func in frames)
    return f"\n\nRank {end.rank}'s Python stack when last seen (most recent call first):\n{lines}"


def _hung_error(hung: Sequence[RankEnd], ends: Sequence[RankEnd], pids: list[int]) -> LaunchError:
    n = len(ends)
    first = hung[0]
    victims = sorted(
        (e for e in ends if e.traceback and is_victim(e.traceback)),
        key=lambda e: (e.raised_at or 0.0, e.rank),
    )
    waited = "; ".join(f"rank {e.rank}: {exception_line(e.traceback)}" for e in victims)
    who = "rank" if len(victims) == 1 else "ranks"
    names = ", ".join(str(e.rank) for e in victims)
    where = last_seen(first.stack)
    seen = f"; last seen in: {where}" if where else " (its stack could not be read)"
    also = ""
    if len(hung) > 1:
        also = "\n(also still running, and stopped: " + ", ".join(
            str(e.rank) + (f" (last seen in: {last_seen(e.stack)})" if e.stack else "")
            for e in hung[1:]
        )
        also += ")"
    return LaunchError(
        f"rank {first.rank} of {n} (pid {first.pid}) did not arrive{seen}. It was still "
        f"running when {who} {names} gave up waiting for it in a collective, and launch() "
        f"stopped it.\n(then, as a consequence: {waited}){also}\n"
        "Look for a rank stuck outside the collectives the others entered (a loop, a blocking "
        "read, a collective only some ranks call), or raise the process group's timeout if "
        f"it was only slow.{_stack_text(first)}\n\n"
        f"Traceback from rank {victims[0].rank}:\n{victims[0].traceback}",
        rank=first.rank,
        pid=first.pid,
        exitcode=None,
        pids=pids,
    )


def explain(ends: Sequence[RankEnd], *, timed_out: float | None = None) -> LaunchError | None:
    """The :class:`LaunchError` for how the ranks ended; ``None`` when every rank returned.

    ``timed_out`` is the launch's own timeout when it ran out (every rank still running
    was stopped). A rank that returned its result and then died while shutting down
    is no failure when every rank returned (the caller logs it).
    """
    ends = sorted(ends, key=lambda e: e.rank)
    n = len(ends)
    pids = [e.pid for e in ends]
    if timed_out is not None:
        running = [e for e in ends if e.ended_at is None and not e.returned]
        done = [e.rank for e in ends if e.returned]
        also = f" (rank(s) {done} had returned their results)" if done else ""
        seen = "".join(
            f"\nrank {e.rank} last seen in: {last_seen(e.stack)}" for e in running if e.stack
        )
        return LaunchError(
            f"launch() timed out after {timed_out:g}s with rank(s) {[e.rank for e in running]} "
            f"still running; all were killed{also}. Look for a rank waiting in a collective for "
            f"one that never arrived, or raise timeout=.{seen}",
            rank=None,
            pid=None,
            exitcode=None,
            pids=pids,
        )
    if all(e.returned for e in ends):
        return None
    # (when, exception before death, rank): the earliest cause; ties go to an exception.
    causes = [
        ((e.raised_at or 0.0), 0, e.rank, e)
        for e in ends
        if e.traceback and not is_victim(e.traceback)
    ]
    causes += [((e.ended_at or 0.0), 1, e.rank, e) for e in ends if _dead(e)]
    if causes:
        cause = min(causes, key=lambda c: c[:3])[3]
        text = _cause_line(cause, n) + ("" if cause.traceback else ".")
        text += _others(cause, ends, ())
        if cause.traceback:
            text += f"\n\nTraceback from rank {cause.rank}:\n{cause.traceback}"
        return LaunchError(
            text,
            rank=cause.rank,
            pid=cause.pid,
            exitcode=cause.exitcode,
            traceback_text=cause.traceback,
            pids=pids,
        )
    hung = [e for e in ends if e.ended_at is None and not e.returned and not e.traceback]
    victims = sorted((e for e in ends if e.traceback), key=lambda e: (e.raised_at or 0.0, e.rank))
    if hung and victims:
        return _hung_error(hung, ends, pids)
    if victims:
        cause = victims[0]
        text = _cause_line(cause, n) + _others(cause, ends, hung)
        return LaunchError(
            f"{text}\n\nTraceback from rank {cause.rank}:\n{cause.traceback}",
            rank=cause.rank,
            pid=cause.pid,
            exitcode=cause.exitcode,
            traceback_text=cause.traceback,
            pids=pids,
        )
    missing = [e.rank for e in ends if not e.returned]
    return LaunchError(  # pragma: no cover - launch() stops ranks only after a failure
        f"launch(): rank(s) {missing} did not return a result, for no reason launch() saw.",
        rank=missing[0],
        pid=pids[missing[0]],
        exitcode=None,
        pids=pids,
    )
