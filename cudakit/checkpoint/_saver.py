"""The save side of a run: when a save is due, what it records, and a stop signal's exit.

:class:`Saver` owns the :class:`~cudakit.checkpoint._writer.Writer` (a save's files and
``keep=``), the :class:`~cudakit.checkpoint._policy.SavePolicy` (when a save is due)
and the :class:`~cudakit.checkpoint._preemption.Preemption` watcher (a stop signal,
agreed by every rank). At each window boundary it counts the window on the
:class:`~cudakit.checkpoint._cursor.Cursor` it shares with the loop, saves when due,
and after a stop saves, closes the run and exits. The
:class:`~cudakit.checkpoint.Checkpointer` composes it with the loop and the resume.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..exceptions import CheckpointSaveError
from . import _layout as layout
from . import _progress as progress
from ._args import Options
from ._cursor import Cursor
from ._policy import SavePolicy
from ._preemption import Preemption
from ._ranks import Ranks
from ._state import FreshStepError, extras_state, fresh_optimizers, reset_fresh, tensor_state
from ._writer import Pending, Writer, drain_background
from .data import Position, is_stateful

__all__ = ["Saver"]

log = logging.getLogger("cudakit.checkpoint")


class Saver:
    """Saves a run when a save is due or asked for, and exits after a stop signal."""

    def __init__(
        self,
        options: Options,
        ranks: Ranks,
        cursor: Cursor,
        *,
        protect: Callable[[], list[Path]],
        close: Callable[[], None],
    ) -> None:
        self.directory = options.root
        #: The loader whose state is saved, and the extras (the Checkpointer's, set there).
        self.loader: Any = options.loader
        self.extras: dict[str, Any] = options.parts.extras
        self._parts = options.parts
        # The steps' windows, bound once: their positions are read at each batch.
        self._windows = tuple(s.window for s in options.parts.steps)
        self._ranks = ranks
        self._cursor = cursor  # (shared with the loop, which moves it)
        self._close = close  # (the whole run's, before a stop's exit)
        #: Writes checkpoints into :attr:`directory` and keeps the ``keep`` newest.
        self.writer = Writer(
            self.directory,
            rank=ranks.rank,
            keep=options.keep,
            background=options.background,
            group=ranks.save_group,
            distributed=ranks.distributed,
            protect=protect,
            safe_globals=options.safe_globals,
        )
        #: The stop signals watched, and every rank's agreement on them.
        self.preemption = Preemption(
            options.preemption, ranks.control, options.requeue, options.exit_code
        )
        #: Whether a save is due at a boundary, and what was saved last.
        self.policy = SavePolicy(options.every)

    def at_window_end(self) -> bool:
        """Whether every step is between accumulation windows."""
        for window in self._windows:  # noqa: SIM110 (a generator costs calls at each batch)
            if window.position:
                return False
        return True

    def boundary(self) -> Path | None:
        """At most once per batch: count the window, poll the stop flag, save if due."""
        policy = self.policy
        if not self.at_window_end() or not policy.first_look(self._cursor.position):
            return None
        pos = self._cursor.count_window()
        if self.writer.pending is not None and self.writer.done():
            self.writer.finish()
        stop = self.preemption.poll()
        due = policy.due(pos)
        saved = self.save_now() if (due or stop) and policy.unsaved(pos) else None
        if stop:
            self._exit_after_stop()
        return saved

    def save(self) -> Path | None:
        """Save now, or ask for a save at the end of the current accumulation window."""
        if not self.at_window_end():
            self.policy.requested = True
            return None
        cursor, steps = self._cursor, self._parts.steps
        if cursor.before_step(steps):  # (a position saved already is not written again)
            done = self.policy.saved_just_before(cursor.position)
            return self.writer.newest if done else self.save_now(unconsumed=True)
        # A window that ended since the last boundary (a step, a flush()) is counted first.
        saved = self.boundary() if cursor.yielded is not None or steps else None
        if saved is not None:
            return saved
        if cursor.yielded is None:  # a loop of its own: what the steps closed, or the saves
            cursor.position = progress.explicit_save(cursor.position, steps)
        return self.save_now()

    def save_now(self, unconsumed: bool = False) -> Path:
        """Save now; ``unconsumed``: without the batch just yielded, which a resume steps on."""
        pos = self._cursor.saved_position(unconsumed)
        name = layout.checkpoint_name(pos.windows)
        partial = self.directory / (name + layout.PARTIAL)
        final = self.directory / name
        parts = self._parts
        fresh = fresh_optimizers(parts)
        try:
            # The host state first: the steps' state settles a pending (sync-free) verdict,
            # which may put the schedulers and learning rates back, before they are read.
            host = self._host_state(fresh, pos, unconsumed)
            try:
                tensors = tensor_state(parts)
            except FreshStepError as exc:
                raise CheckpointSaveError(
                    f"Checkpointer.save(): optimizer {exc.index} ({exc.kind}) has no state "
                    "yet, and DCP's get_state_dict makes one for the checkpoint by stepping "
                    f"it once with zero gradients, which failed ({exc.cause}). Nothing was "
                    "saved or changed. Save after its first step."
                ) from exc
            fields = {
                "total": pos.total,
                "epoch": pos.epoch,
                "batch": pos.batch,
                "windows": pos.windows,
                "world_size": self._ranks.world,
                "models": tuple(parts.models),
                "optimizers": len(parts.optimizers),
                "schedulers": len(parts.schedulers),
                "steps": len(parts.steps),
                "mid_epoch_data": self.loader is not None and pos.batch > 0,
            }
            self.writer.write(tensors, host, Pending(partial, final, fields))
        finally:
            reset_fresh(parts, fresh)
        self.policy.saved(pos)
        return final

    def wait(self) -> Path | None:
        """Finish a background save in flight, and the removal of the checkpoints ``keep=``
        let go; returns the save's path (None: no save was in flight)."""
        try:
            return self.writer.finish()
        finally:
            drain_background()

    def _host_state(self, fresh: list[bool], pos: Position, unconsumed: bool) -> dict[str, Any]:
        loader = self.loader
        return {
            "format": layout.HOST_FORMAT,
            "rank": self._ranks.rank,
            "world_size": self._ranks.world,
            "position": dataclasses.asdict(pos),
            "rng": self._cursor.rng_state(loader, pos, unconsumed),
            "epoch_rng": self._cursor.epoch_rng if pos.batch > 0 else None,
            "steps": [s.state_dict() for s in self._parts.steps],
            "schedulers": [s.state_dict() for s in self._parts.schedulers],
            "fresh": fresh,
            "loader": loader.state_dict() if loader is not None and is_stateful(loader) else None,
            "extras": extras_state(self.extras),
        }

    def _exit_after_stop(self) -> None:
        self.wait()
        code = self.preemption.exit_status(self._ranks.rank)
        log.warning(
            "cudakit: stop signal: saved %s, exiting with status %d", self.writer.last, code
        )
        self._close()
        self._ranks.exit_together()
        raise SystemExit(code)
