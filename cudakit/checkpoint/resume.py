"""The resume side of a run: which checkpoint it continues from, and loading it.

:func:`find_latest` names the newest complete checkpoint of a directory.
:class:`ResumeChoice` owns the choice for one run: whether it was made, the
candidates in order (the newest, then the one written before it when the safe loader
refuses one), each broadcast from rank 0 on the control group, and the refusal of a
loop that saves into a directory it never resumed from. :class:`Resumer` owns the
choice and the checkpoint the run resumed from: it loads a checkpoint into the run's
parts, puts back the :class:`~cudakit.checkpoint._cursor.Cursor` it shares with the
loop and tells the save policy, and keeps the checkpoint it loaded from ``keep=``
until the run completes one of its own. The :class:`~cudakit.checkpoint.Checkpointer`
composes it with the loop and the save side.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import _args as arguments
from . import _layout as layout
from . import _reader as reader
from ._announce import Announcer
from ._args import Options
from ._cursor import Cursor
from ._policy import SavePolicy
from ._ranks import Ranks
from ._writer import drain_background
from .data import Position

__all__ = ["ResumeChoice", "Resumer", "find_latest"]

log = logging.getLogger("cudakit.checkpoint")


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


class Resumer:
    """Resumes a run: chooses the checkpoint, loads it, and remembers which it was."""

    def __init__(
        self,
        options: Options,
        ranks: Ranks,
        cursor: Cursor,
        announce: Announcer,
        *,
        policy: SavePolicy,
        loader: Callable[[], Any],
        extras: Callable[[], dict[str, Any]],
        written: Callable[[], Path | None],
    ) -> None:
        self._options = options
        self._ranks = ranks
        self._cursor = cursor  # (shared with the loop, which moves it)
        self._policy = policy  # (the saver's: a loaded position counts as saved)
        # The loader and extras as they are now (the Checkpointer's, which may be set
        # later), and the last checkpoint this run completed (the saver's writer's).
        self._loader = loader
        self._extras = extras
        self._written = written
        #: Which checkpoint to resume, agreed by every rank.
        self.choice = ResumeChoice(options.root, ranks.rank, ranks.control, announce)
        #: The checkpoint this run resumed from (None: a fresh start).
        self.resumed_from: Path | None = None

    def resume(self) -> Position:
        """Load the newest complete checkpoint the safe loader admits, if any, once."""
        if self.choice.done:
            return self._cursor.position
        drain_background()  # an abandoned save of this process must not write on
        choice = self.choice
        for path in choice.candidates():
            try:
                position = self.load(path)
            except reader.RefusedCheckpointError as exc:  # maybe tampered: the one before
                # (stacklevel 3: the caller of Checkpointer.resume)
                warnings.warn(f"cudakit: skipping checkpoint {path}: {exc}", UserWarning, 3)
            else:
                choice.announce.resumed(path, position, choice.cleared)
                return position
        choice.announce.resumed(None, self._cursor.position, choice.cleared)
        return self._cursor.position

    def load(self, path: str | os.PathLike[str]) -> Position:
        """Load one checkpoint into the run's parts, the cursor and the save policy."""
        root = arguments.resolve_directory("Checkpointer.load", path)
        options, ranks, loader = self._options, self._ranks, self._loader()
        host, manifest = reader.read(
            root,
            options.parts,
            ranks.rank,
            ranks.world,
            ranks.distributed,
            extras=self._extras(),
            loader=loader,
            group=ranks.control,
            trust=options.trust_pickles,
            safe_globals=options.safe_globals,
        )
        epoch_rng = reader.apply_host(host, manifest, loader=loader, rank=ranks.rank)
        pos = Position(**host["position"])
        self._cursor.restored(pos, epoch_rng, loader)
        self._policy.restored(pos)
        self.resumed_from = root
        self.choice.done = True
        log.info("cudakit: resumed from %s at %s", root, pos)
        return pos

    def check_fresh(self) -> None:
        """Before a loop with its own data saves: refuse a directory that holds a
        checkpoint this run never resumed from (see :meth:`ResumeChoice.check_fresh`)."""
        if not self.choice.done:
            self.choice.check_fresh()

    def protected(self) -> list[Path]:
        """What ``keep=`` must not remove: the checkpoint resumed from, until this run
        completes one of its own."""
        if self.resumed_from is not None and self._written() is None:
            return [self.resumed_from]
        return []
