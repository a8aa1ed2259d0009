"""What a failed save advises: freeing space only when the disk (or quota) is full.

A save fails for many reasons: a full disk or quota, a directory that is not writable,
a file that another process removed, an error inside DCP on one rank. The advice at
the end of a :class:`~cudakit.exceptions.CheckpointSaveError` follows the cause found
in the exception (DCP wraps each rank's in ``failures``), never a guess.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

__all__ = ["fix_for"]

_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}
_VANISHED = {errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST, errno.ESTALE}


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, the errors it was raised from, and those DCP gathered from each rank."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        err = todo.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict):
            for inner in failures.values():
                inner_exc = inner[0] if isinstance(inner, tuple) else inner
                if isinstance(inner_exc, BaseException):
                    todo.append(inner_exc)
        todo += [e for e in (err.__cause__, err.__context__) if e is not None]


def fix_for(exc: BaseException, root: Path) -> str:
    """The advice for a save into ``root`` that failed with ``exc``.

    >>> fix_for(OSError(errno.ENOSPC, "No space left on device"), Path("ckpt"))
    'Free space on the disk (or choose another directory) and save again.'
    >>> fix = fix_for(RuntimeError("rank 1 went away"), Path("ckpt"))
    >>> fix.startswith("Fix the cause above and save again; resume() goes on from")
    True
    """
    codes = {e.errno for e in _causes(exc) if isinstance(e, OSError) and e.errno is not None}
    if codes & _FULL:
        return "Free space on the disk (or choose another directory) and save again."
    if codes & _DENIED:
        return (
            f"This process may not write in {root} (its permissions, or a read-only file "
            "system): fix that or choose another directory, and save again."
        )
    if codes & _VANISHED:
        return (
            f"A file of this save changed or vanished while it was written: is another "
            f"process removing files in {root}? Give each run a directory of its own, "
            "and save again."
        )
    return "Fix the cause above and save again; resume() goes on from the previous checkpoint."
