"""Where a reporter's line goes: ``file=`` (stderr by default) and ``log=``.

The conventions of :func:`~cudakit.memory_report`, in one place for reporters that
write a line: ``file=`` a text stream (default: whatever ``sys.stderr`` is when the
line is written, or nowhere when ``log=`` is given), ``None`` for silence; ``log=`` a
``logging.Logger`` (lines at INFO) or a callable that takes the line.
"""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Callable
from typing import IO, Final

from ._check import fail_type

__all__ = [
    "STDERR",
    "LogTarget",
    "Stderr",
    "check_file",
    "check_log",
    "describe_target",
    "write_line",
]

#: ``log=``: a ``logging.Logger`` (each line at INFO) or a function that takes the line.
LogTarget = logging.Logger | Callable[[str], object]


class Stderr:
    """The type of :data:`STDERR`, the default of ``file=``: ``sys.stderr`` when a line is written.

    Pass ``file=None`` for silence or a text stream of your own; this type is only
    the default's.
    """

    def __repr__(self) -> str:
        return "sys.stderr"


#: The default of ``file=``: the line goes to whatever ``sys.stderr`` is when it is
#: written (so pytest's capture and a redirected stderr get it).
STDERR: Final = Stderr()


def check_file(func: str, file: object) -> IO[str] | Stderr | None:
    """``file=`` at the door: None, the default, or a text stream (binary ones refused)."""
    if file is None or isinstance(file, Stderr):
        return file
    binary = isinstance(file, (io.RawIOBase, io.BufferedIOBase)) or "b" in str(
        getattr(file, "mode", "")
    )
    if binary or not callable(getattr(file, "write", None)):
        fix = (
            "It is a binary stream: open the file with 'w' (text), or wrap the stream: "
            "io.TextIOWrapper(stream)."
            if binary
            else "To send lines to a logger or a function, use log=."
        )
        fail_type(
            func,
            "file",
            "a text stream with .write() (sys.stdout, a file opened with 'w') or None to "
            "stay silent",
            file,
            fix,
        )
    if getattr(file, "closed", False) is True:
        raise ValueError(
            f"{func}(file=...) got a closed file {describe_target(file, None)}; pass a text "
            "stream that is still open (open it before and close it after the reports), or None."
        )
    return file  # type: ignore[return-value]


def describe_target(file: object, log: object) -> str:
    """Where a line goes, for a message: a file's name, ``sys.stderr`` or ``log=``."""
    if isinstance(file, Stderr) or file is None:
        return "log=" if log is not None else "sys.stderr"
    name = getattr(file, "name", None)
    where = repr(name) if isinstance(name, str) else type(file).__name__
    return where if log is None else f"{where} or log="


def check_log(func: str, log: object) -> LogTarget | None:
    """``log=`` at the door: None, a ``logging.Logger`` or a callable."""
    if log is not None and not isinstance(log, logging.Logger) and not callable(log):
        fail_type(
            func,
            "log",
            "a logging.Logger or a callable that accepts the line",
            log,
            "For example: log=logging.getLogger(__name__).",
        )
    return log


def write_line(line: str, file: IO[str] | Stderr | None, log: LogTarget | None) -> None:
    """Write ``line`` to ``file`` (stderr unless ``log`` is given) and/or ``log``."""
    if isinstance(file, Stderr):
        file = None if log is not None else sys.stderr
    if file is not None:
        file.write(line + "\n")
        flush = getattr(file, "flush", None)
        if flush is not None:
            flush()
    if log is not None:
        if isinstance(log, logging.Logger):
            log.info(line)
        else:
            log(line)
