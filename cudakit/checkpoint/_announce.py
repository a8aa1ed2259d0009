"""The line a resume writes: which checkpoint, at which step, what was cleared.

The conventions of cudakit's other reporters (:func:`~cudakit.speed_report`,
:func:`~cudakit.memory_report`): ``file=`` a text stream, ``sys.stderr`` by default,
``None`` for silence; ``log=`` a ``logging.Logger`` (the line at INFO) or a function
that takes the line. Rank 0 writes it; the other ranks load the same checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import IO

from .._output import LogTarget, Stderr, write_line
from .data import Position

__all__ = ["Announcer", "resumed_line"]


def resumed_line(path: Path | None, position: Position, cleared: Sequence[Path]) -> str:
    """The line: where the run continues, and the half-written saves removed.

    >>> path = Path("ckpt/ckpt-0000000020")
    >>> print(resumed_line(path, Position(2, 5, 85, 20), []))
    cudakit.Checkpointer: resumed from ckpt/ckpt-0000000020 at step 20
    (epoch 2, batch 5)
    >>> half = Path("ckpt/ckpt-0000000004.partial")
    >>> print(resumed_line(None, Position(), [half]))
    cudakit.Checkpointer: no complete checkpoint in ckpt, starting fresh;
    removed the half-written ckpt-0000000004.partial
    """
    if path is not None:
        line = (
            f"cudakit.Checkpointer: resumed from {path} at step {position.windows} "
            f"(epoch {position.epoch}, batch {position.batch})"
        )
    else:
        line = (
            f"cudakit.Checkpointer: no complete checkpoint in {cleared[0].parent}, starting fresh"
        )
    if cleared:
        names = ", ".join(p.name for p in cleared)
        line += f"; removed the half-written {names}"
    return line


class Announcer:
    """Writes a Checkpointer's resume line where ``file=``/``log=`` say (rank 0 only)."""

    def __init__(self, file: IO[str] | Stderr | None, log: LogTarget | None, rank: int) -> None:
        self.file, self.log, self.rank = file, log, rank

    def resumed(self, path: Path | None, position: Position, cleared: Sequence[Path]) -> None:
        """Say where the run continues; a fresh start says nothing unless it cleared a save."""
        if self.rank != 0 or (path is None and not cleared):
            return
        write_line(resumed_line(path, position, cleared), self.file, self.log)
