"""Which checkpoint a run continues from, chosen by rank 0 and agreed by every rank.

:func:`find_latest` names the newest complete checkpoint of a directory.
:class:`ResumeChoice` owns the choice for one run: whether it was made, the
candidates in order (the newest, then the one written before it when the safe loader
refuses one), each broadcast from rank 0 on the control group, and the refusal of a
loop that saves into a directory it never resumed from.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import arguments, layout, reader
from .announce import Announcer

__all__ = ["ResumeChoice", "find_latest"]


def find_latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None when there is none.

    The newest is the one written last: after a run rolled back to an older checkpoint
    (``load(path)``) and saved again, its own checkpoints are newer than the abandoned
    ones of higher step numbers. Incomplete checkpoints (a save that never finished)
    and corrupted ones (a file missing or truncated) are skipped, with a warning that
    names each.

    >>> import tempfile
    >>> find_latest(tempfile.mkdtemp()) is None
    True

    .. versionadded:: 0.1
    """
    root = arguments.resolve_directory("find_latest", directory)
    found = layout.list_checkpoints(root)
    for path, why in found.broken:
        warnings.warn(f"cudakit: skipping checkpoint {path}: {why}.", UserWarning, stacklevel=2)
    latest = found.latest
    return latest[0] if latest is not None else None


class ResumeChoice:
    """The checkpoint a run resumes from, the same on every rank."""

    def __init__(self, directory: Path, rank: int, group: Any, announce: Announcer) -> None:
        self.directory = directory
        self._rank = rank
        self._group = group  # the control group (None: one process)
        #: Whether the run resumed, or started fresh knowing there was nothing to resume.
        self.done = False
        #: The half-written saves rank 0 removed before choosing.
        self.cleared: list[Path] = []
        #: Where the line that says where the run continues goes.
        self.announce = announce

    def candidates(self) -> Iterator[Path]:
        """The newest complete checkpoint, then, each time the caller comes back (the one
        given was refused), the one written before it. Rank 0 clears half-written saves
        first."""
        path: Path | None = None
        if self._rank == 0:
            self.cleared = layout.remove_stale_partials(self.directory)
            path = find_latest(self.directory)
        path = self.agree(path)
        self.done = True
        while path is not None:
            yield path
            path = self.agree(reader.written_before(self.directory, path))

    def check_fresh(self) -> None:
        """A loop with its own data that never resumed: fine in an empty directory only
        (loading now would overwrite the step that just ran)."""
        path = find_latest(self.directory) if self._rank == 0 else None
        path = self.agree(path)
        if path is not None:
            raise RuntimeError(
                f"Checkpointer.maybe_save() before resume(): {self.directory} holds {path}, "
                "which this run has not loaded, and loading it now would overwrite the step "
                "that just ran. Call ckpt.resume() once before the loop (it loads the newest "
                "checkpoint and returns the position to continue from), or use a new "
                "directory."
            )
        self.done = True  # nothing to resume: the run starts here

    def agree(self, path: Path | None) -> Path | None:
        """Rank 0's ``path``, on every rank."""
        if self._group is None:
            return path
        import torch.distributed as dist

        box: list[Any] = [str(path) if path is not None else None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return Path(box[0]) if box[0] is not None else None
