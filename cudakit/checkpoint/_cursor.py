"""The run's place in its data: the position, and the iterator that moves it.

:class:`Cursor` owns the :class:`~cudakit.checkpoint.data.Position`, the batches a
resumed epoch must skip, the RNG states of the epoch's start (to replay a mid-epoch
loader), and the batch :meth:`~cudakit.checkpoint.Checkpointer.batches` yielded last.
It counts batches and windows, and says what a save taken now records of the data;
when to save is :class:`~cudakit.checkpoint._policy.SavePolicy`'s decision.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ._state import epoch_end, step_marks
from .data import (
    Position,
    Yielded,
    advance,
    capture_rng,
    fetched,
    generators_of,
    is_stateful,
    loader_length,
    restore_rng,
    set_epoch,
    skip_batches,
)

__all__ = ["Cursor"]


class Cursor:
    """Where the run stands in its data, and the iterator over an epoch's batches."""

    def __init__(self) -> None:
        #: Where the run stands (see :class:`Position`).
        self.position = Position()
        #: The RNG states at the epoch's start (None: a stateful loader, or not begun).
        self.epoch_rng: dict[str, Any] | None = None
        # Batches the next epoch iterator skips (a resumed mid-epoch position).
        self._skip = 0
        # The batch batches() yielded, counted there, while its loop body runs (else None).
        self.yielded: Yielded | None = None

    def restored(self, pos: Position, epoch_rng: dict[str, Any] | None, loader: Any) -> None:
        """Continue from a loaded checkpoint's position (its data replayed on the next epoch)."""
        self.position = pos
        self.epoch_rng = epoch_rng
        self._skip = pos.batch if loader is not None and not is_stateful(loader) else 0

    def count_batch(self) -> None:
        """One more batch consumed (a loop with its own data, through ``maybe_save()``)."""
        self.position = advance(self.position, 1, 0)

    def count_window(self) -> Position:
        """A window ended at this batch: counted, unless nothing ran yet."""
        pos = self.position
        if pos.batch or pos.total:
            self.position = pos = advance(pos, 0, 1)
        return pos

    def end_epoch(self, epoch: int) -> None:
        """``epoch`` is over; its data came from the user's own loop if it did not move."""
        pos = self.position
        if pos.epoch == epoch:
            self.position = dataclasses.replace(pos, epoch=epoch + 1, batch=0)

    def batches(
        self,
        loader: Any,
        steps: Sequence[Any],
        boundary: Callable[[], object],
        until: int | None = None,
    ) -> Iterator[Any]:
        """Yield this epoch's batches from ``loader``, ``boundary()`` after each step.

        A resumed epoch skips the batches it consumed, with the order and RNG of the
        run that saved them. ``until``: stop once the run has made that many steps.
        """
        start = self.position
        stateful = is_stateful(loader)
        gens = generators_of(loader)
        if not stateful:
            set_epoch(loader, start.epoch)
        skip, self._skip = self._skip, 0
        if skip and self.epoch_rng is not None:
            now = capture_rng(gens)
            restore_rng(self.epoch_rng, gens)
            iterator = iter(loader)
            skip_batches(iterator, skip)
            restore_rng(now, gens)
        else:
            self.epoch_rng = None if stateful else capture_rng(gens)
            iterator = iter(loader)
            if skip:
                skip_batches(iterator, skip)
        length, token = loader_length(loader), object()
        try:
            for batch, before in fetched(iterator, rng=not stateful):
                self.count_batch()
                marks = step_marks(steps)
                self.yielded = Yielded(self.position.total, marks, before, stateful, token)
                # (The epoch's last batch: a partial window's micro-step syncs, for flush().)
                with epoch_end(steps, self.position.batch == length):
                    yield batch
                self.yielded = None
                if length is None or self.position.batch < length:
                    # (The last batch's save point is the epoch's end, as (epoch + 1, 0),
                    # once the iterator is exhausted: a sampler may still draw from the RNG.)
                    boundary()
                    if until is not None and self.position.windows >= until:
                        return  # a step budget's end, mid-epoch (see budget.py)
        finally:  # (a generator closed late leaves a newer one's batch as it is)
            if self.yielded is not None and self.yielded.owner is token:
                self.yielded = None
        self.position = dataclasses.replace(self.position, epoch=start.epoch + 1, batch=0)
        boundary()

    def before_step(self, steps: Sequence[Any]) -> bool:
        """Whether no step ran a backward since batches() yielded its batch (a save at the
        top of the body); unknown without a step, or with a stateful loader (moved on)."""
        now = self.yielded
        return (
            now is not None
            and bool(steps)
            and self.position.total == now.total
            and not now.stateful
            and all(map(operator.is_, step_marks(steps), now.marks))
        )

    def saved_position(self, unconsumed: bool) -> Position:
        """The position a save records; ``unconsumed``: without the batch just yielded."""
        pos = self.position
        if unconsumed:
            pos = dataclasses.replace(pos, batch=pos.batch - 1, total=pos.total - 1)
        return pos

    def rng_state(self, loader: Any, pos: Position, unconsumed: bool) -> dict[str, Any]:
        """The RNG states a save of ``pos`` records, so that a resume draws what came next."""
        gens = generators_of(loader) if loader is not None else ()
        if unconsumed and pos.batch == 0 and self.epoch_rng is not None:
            return self.epoch_rng  # before an epoch's first step: its start (its iterator drew)
        rng = capture_rng(gens)
        now = self.yielded
        if unconsumed and now is not None and now.rng is not None:
            rng["cpu"] = now.rng  # as the batch was fetched (augmentation)
        return rng
