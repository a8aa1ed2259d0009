"""The :class:`Checkpointer`: a run that survives crashes, preemptions and restarts."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import weakref
from collections.abc import Collection, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from .._check import check_int
from .._dist import group_rank
from .._output import STDERR, check_file, check_log
from . import _args as arguments
from . import _layout as layout
from . import _lock as lock
from ._announce import Announcer
from ._budget import budgeted
from ._cursor import Cursor
from ._ranks import Ranks
from ._saver import Saver
from ._state import warn_open_window
from ._writer import Writer, drain_background
from .data import Position
from .resume import Resumer

__all__ = ["Checkpointer"]

log = logging.getLogger("cudakit.checkpoint")
_FUNC = "Checkpointer"


class Checkpointer:
    """Save everything the next step depends on, and pick a run up where it stopped.

    Made once, on every rank, before the loop. ``epochs()`` resumes from the newest
    complete checkpoint in ``directory`` (or starts fresh), ``batches()`` yields the
    epoch's batches (skipping those a resumed run already consumed) and saves every
    ``every`` optimizer steps at the end of an accumulation window. A SIGTERM or
    SIGUSR1 saves at the next window boundary and exits with a status a scheduler
    requeues on. Running the same command again continues the run.

    >>> import tempfile, torch, cudakit
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> data = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)
    >>> ckpt = cudakit.Checkpointer(tempfile.mkdtemp(), model=model, optimizer=opt,
    ...                             loader=data, every=1, keep=2, preemption=False)
    >>> for epoch in ckpt.epochs(2):
    ...     for x in ckpt.batches():
    ...         opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    >>> ckpt.position
    Position(epoch=2, batch=0, total=4, windows=4)
    >>> [p.name for p in sorted(ckpt.directory.glob("ckpt-*"))]
    ['ckpt-0000000003', 'ckpt-0000000004']
    >>> ckpt.close()

    Args:
        directory: where checkpoints go (made if missing; shared by every rank).
        model: the model (DDP, FSDP2 and compiled models too), or a dict of names to
            models. Default: the ``model=`` of ``step``.
        optimizer: an optimizer or a list. Default: the optimizers of ``step``.
        step: an :func:`~cudakit.autocast_step` (or the function it decorated), or a
            list of them: its state is saved, and saves wait for its window's end.
        scheduler: a scheduler or a list. Default: the schedulers of ``step``.
        loader: the training ``DataLoader`` (``distributed_loader``, ``prefetch`` and
            torchdata's ``StatefulDataLoader`` too) whose position is saved.
        extra: a dict of names to objects with ``state_dict``/``load_state_dict``
            (loaded in place) or plain values (put back into :attr:`extra`).
        keep: keep only the newest ``keep`` complete checkpoints (None: all).
        every: save every ``every`` optimizer steps (None: only on request, on a
            stop signal and at the end of :meth:`epochs`).
        async_save: write in the background; the loop waits only while the state is
            copied to host memory.
        preemption: save and exit on SIGTERM or SIGUSR1 (True), on no signal (False),
            or on the signals given: a name (``"SIGUSR2"``, ``"USR2"``) or a
            ``signal.Signals``, or a list of them.
        exit_code: the status to exit with after a stop signal (default ``128 +``
            the signal's number: 143 for SIGTERM).
        requeue: after a watched signal other than SIGTERM and SIGINT (SIGUSR1 by
            default) under SLURM, ``scontrol requeue`` the job (``"auto"``: when
            ``scontrol`` exists); True also after SIGTERM; False never.
        safe_globals: classes (or functions) of your own that extras may hold, admitted
            by the safe loader that reads checkpoints back (see "What a checkpoint may
            hold" in the docs); any other type is refused at ``save()``.
        trust_pickles: read checkpoints with pickle's full loader, which runs any code a
            file holds: only for checkpoints you wrote, such as those of an older
            cudakit, which the safe loader refuses.
        file: where :meth:`resume` writes its line (the checkpoint and step it resumed
            from, the half-written saves it removed): ``sys.stderr`` by default (or
            nowhere when ``log`` is given), ``None`` for silence, or a text stream.
        log: a ``logging.Logger`` (the line at INFO) or a callable taking the line.

    Raises:
        TypeError, ValueError: a wrong argument (named, with the fix).
        CheckpointSaveError: ``directory`` cannot be written, or another live run uses
            it (named: its host, pid and start time).

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: Any = None,
        optimizer: Any = None,
        step: Any = None,
        scheduler: Any = None,
        loader: Any = None,
        extra: Any = None,
        keep: int | None = None,
        every: int | None = None,
        async_save: bool = False,
        preemption: bool | str | signal.Signals | Collection[str | signal.Signals] = True,
        exit_code: int | None = None,
        requeue: bool | str = "auto",
        safe_globals: Collection[Any] | None = None,
        trust_pickles: bool = False,
        file: Any = STDERR,
        log: Any = None,
    ) -> None:
        options = arguments.resolve(
            directory,
            model=model,
            optimizer=optimizer,
            step=step,
            scheduler=scheduler,
            loader=loader,
            extra=extra,
            keep=keep,
            every=every,
            async_save=async_save,
            preemption=preemption,
            exit_code=exit_code,
            requeue=requeue,
            safe_globals=safe_globals,
            trust_pickles=trust_pickles,
        )
        announcer = Announcer(check_file(_FUNC, file), check_log(_FUNC, log), group_rank())
        self._parts = options.parts
        #: The directory checkpoints go to.
        self.directory: Path = options.root
        self.keep = options.keep
        ranks = Ranks.join(background=options.background)
        layout.probe_writable(self.directory, ranks.rank)
        # One run per directory: rank 0 holds the lock, every rank learns if it may.
        self._held = lock.hold_on_rank0(self.directory, ranks.rank, ranks.control)
        if self._held is not None:
            weakref.finalize(self, self._held.release)  # (a Checkpointer dropped unclosed)
        self._cursor = cursor = Cursor()
        self._saver = saver = Saver(
            options,
            ranks,
            cursor,
            protect=lambda: self._resumer.protected(),  # (keep= spares what it resumed from)
            close=self.close,
        )
        self._resumer = Resumer(
            options,
            ranks,
            cursor,
            announcer,
            policy=saver.policy,
            loader=lambda: saver.loader,
            extras=lambda: saver.extras,
            written=lambda: saver.writer.last,
        )
        self._closed = False
        _OPEN.add(self)

    # ------------------------------------------------------------------ state

    @property
    def position(self) -> Position:
        """Where the run stands: epoch, batches of it consumed, totals (see :class:`Position`)."""
        return self._cursor.position

    @property
    def resumed_from(self) -> Path | None:
        """The checkpoint this run resumed from (None: a fresh start)."""
        return self._resumer.resumed_from

    @resumed_from.setter
    def resumed_from(self, path: Path | None) -> None:
        self._resumer.resumed_from = path

    @property
    def _position(self) -> Position:
        # (the cursor's: tests set it to pretend batches ran)
        return self._cursor.position

    @_position.setter
    def _position(self, pos: Position) -> None:
        self._cursor.position = pos

    @property
    def extra(self) -> dict[str, Any]:
        """The extras as passed; plain values are replaced by their saved ones on load."""
        return self._saver.extras

    @extra.setter
    def extra(self, extras: dict[str, Any]) -> None:
        self._saver.extras = extras

    @property
    def loader(self) -> Any:
        """The loader whose position is saved (``loader=``; may be set later)."""
        return self._saver.loader

    @loader.setter
    def loader(self, loader: Any) -> None:
        self._saver.loader = loader

    @property
    def every(self) -> int | None:
        """Save every ``every`` optimizer steps (None: on request, a stop, the run's end)."""
        return self._saver.policy.every

    @property
    def latest(self) -> Path | None:
        """The newest complete checkpoint in :attr:`directory` (None when there is none)."""
        latest = layout.list_checkpoints(self.directory).latest
        return latest[0] if latest is not None else None

    @property
    def stop_requested(self) -> bool:
        """Whether this process received a watched stop signal (see ``preemption=``)."""
        return self._saver.preemption.requested

    def __repr__(self) -> str:
        return (
            f"Checkpointer({str(self.directory)!r}, position={self.position}, "
            f"keep={self.keep}, every={self.every}, resumed_from={self.resumed_from})"
        )

    @property
    def _writer(self) -> Writer:
        # (the saver's: tests read its plans)
        return self._saver.writer

    # ------------------------------------------------------------------ resume

    def resume(self) -> Position:
        """Load the newest complete checkpoint, if any; returns where the run continues.

        A collective under a process group: rank 0 chooses the checkpoint (skipping
        incomplete and corrupted ones with a warning naming them, and removing saves a
        crash left half-written), every rank loads it. A checkpoint whose files hold what
        the safe loader refuses is skipped for the one before, with a warning.
        Idempotent: a second call returns the position without loading again.

        Raises:
            CheckpointError: the newest complete checkpoint does not fit this run.
        """
        self._check_open("resume")
        return self._resumer.resume()

    def load(self, path: str | os.PathLike[str]) -> Position:
        """Load one checkpoint into the models, optimizers, step, schedulers, RNG and data.

        Everything is checked before anything changes: the manifest and every file's
        size, the number of models, optimizers, schedulers and steps, the tensors'
        names and shapes, and the world size where the data position depends on it.
        A plain model's weights and its optimizer's state are read into their own
        memory last, as ``load_state_dict`` writes them.

        Returns:
            The position the checkpoint was taken at.

        Raises:
            CheckpointError: a corrupted or incomplete checkpoint, or one that does not
                fit (missing and unexpected keys, another optimizer count, a mid-epoch
                data position at another world size), naming what differs; a file that
                holds what the safe loader refuses, naming it and the refused global;
                a data file that cannot be read after all the checks, saying the
                models and optimizers are partly loaded.
        """
        self._check_open("load")
        return self._resumer.load(path)

    # ------------------------------------------------------------------ the loop

    def epochs(self, stop: int) -> Iterator[int]:
        """Yield epoch numbers from where the run stands up to ``stop``; resumes first.

        When the loop finishes, a last checkpoint is saved (if anything happened since
        the last one) and waited for, so running the command again does nothing more.
        A run that ends inside an accumulation window (no ``flush()``) saves none: it logs why.
        """
        return self._epochs(check_int("Checkpointer.epochs", "stop", stop, minimum=0))

    def _epochs(self, stop: int) -> Iterator[int]:
        self.resume()
        cursor = self._cursor
        while cursor.position.epoch < stop:
            epoch = cursor.position.epoch
            yield epoch
            cursor.end_epoch(epoch)
            self._saver.boundary()
        self._finish_run()

    def _finish_run(self) -> None:
        """The end of a run (its epochs, its step budget): the last save, waited for."""
        cursor, policy = self._cursor, self._saver.policy
        if policy.unsaved(cursor.position) and self._saver.at_window_end():
            self.save()
        self.wait()
        if policy.unsaved(cursor.position):  # the last window is open
            warn_open_window(self._parts.steps, self.latest)

    def batches(self, loader: Any = None, *, steps: int | None = None) -> Iterator[Any]:
        """Yield this epoch's batches from ``loader`` (default: the one passed at creation).

        A resumed run skips the batches its epoch already consumed, with the same order
        and RNG as the run that saved. Between batches, after the step has run, it saves
        when due and reacts to a stop signal.

        With ``steps=N`` (instead of :meth:`epochs`), a run budgeted in optimizer steps:
        the batches come epoch after epoch until the run has made ``N`` optimizer steps
        in all (a resumed run makes those left); then the last checkpoint is saved and
        waited for. A finished run started again yields no batch.
        """
        loader = arguments.batches_loader(loader, self.loader)
        if steps is None:
            return self._batches(loader)
        budget = check_int("Checkpointer.batches", "steps", steps, minimum=0)
        return budgeted(
            loader,
            budget,
            resume=self.resume,
            position=lambda: self.position,
            epoch=self._batches,
            finish=self._finish_run,
        )

    def _batches(self, loader: Any, until: int | None = None) -> Iterator[Any]:
        """One epoch's batches; ``until``: stop once the run has made that many steps."""
        self.resume()
        yield from self._cursor.batches(loader, self._parts.steps, self._saver.boundary, until)

    def maybe_save(self) -> Path | None:
        """Count one batch, and save if one is due (``every``, a request, a stop signal)
        at a window's end.

        Call it after each call of the step (each micro-batch), on every rank, when the
        loop brings its own data instead of :meth:`batches` (which counts the batches
        and checks between them itself: inside it, this only checks; close a batches()
        generator you leave). Returns the checkpoint's path when it saved.
        """
        if self._closed:
            self._check_open("maybe_save")
        if self._cursor.yielded is None:  # (inside batches(), which counted its batch: a check)
            self._resumer.check_fresh()
            self._cursor.count_batch()
        return self._saver.boundary()

    def save(self) -> Path | None:
        """Save now, or at the end of the current accumulation window.

        A collective: every rank calls it. Mid-window (``autocast_step`` with
        ``accumulate > 1``) the save is taken at the window's end by
        :meth:`batches`/:meth:`maybe_save`, and this returns None. With
        ``async_save=True`` the returned path becomes visible when the background
        write finishes (:meth:`wait`).

        Raises:
            CheckpointSaveError: the checkpoint could not be written (a full disk):
                nothing of it is visible, the previous one is intact.
        """
        self._check_open("save")
        return self._saver.save()

    def wait(self) -> Path | None:
        """Finish a background save in flight, and the removal of the checkpoints ``keep=``
        let go; returns the save's path (None: no save was in flight)."""
        return self._saver.wait()

    def close(self) -> None:
        """Finish a background save, stop watching signals. Idempotent; also at exit."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        try:
            self._saver.writer.finish()
        finally:
            drain_background()  # (the removals keep= started, before the lock goes)
            self._saver.preemption.close()
            if self._held is not None:
                self._held.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ machinery

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"Checkpointer.{method}() after close(): make a new Checkpointer for another run."
            )


_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


@atexit.register
def _finish_at_exit() -> None:
    """Finish background saves still in flight when the interpreter exits."""
    for ckpt in list(_OPEN):
        try:
            ckpt.close()
        except Exception as exc:  # pragma: no cover - reported, never raised at exit
            log.error("cudakit: finishing %s at exit failed: %s", ckpt.directory, exc)
