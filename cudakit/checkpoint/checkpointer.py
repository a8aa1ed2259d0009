"""The :class:`Checkpointer`: a run that survives crashes, preemptions and restarts."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import operator
import os
import signal
import warnings
import weakref
from collections.abc import Collection, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from typing_extensions import Self

from .._check import check_int
from .._dist import group_rank, group_world_size, is_group_running
from .._output import STDERR, check_file, check_log
from ..exceptions import CheckpointSaveError
from . import arguments, layout, lock, progress, reader
from .announce import Announcer
from .data import (
    Position,
    Yielded,
    capture_rng,
    fetched,
    generators_of,
    is_stateful,
    loader_length,
    restore_rng,
    set_epoch,
    skip_batches,
)
from .preemption import SignalWatch, StopAgreement, after_stop
from .state import (
    extras_state,
    fresh_optimizers,
    reset_fresh,
    step_marks,
    tensor_state,
    warn_open_window,
)
from .writer import Pending, Writer, drain_background

__all__ = ["Checkpointer", "find_latest"]

log = logging.getLogger("cudakit.checkpoint")
_FUNC = "Checkpointer"


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
        self._options = options
        self._parts = options.parts
        #: The directory checkpoints go to.
        self.directory: Path = options.root
        #: The extras as passed; plain values are replaced by their saved ones on load.
        self.extra: dict[str, Any] = self._parts.extras
        self.loader: Any = options.loader
        self.keep = options.keep
        self.every = options.every
        self._distributed = is_group_running()
        self._rank = group_rank()
        self._world = group_world_size()
        layout.probe_writable(self.directory, self._rank)
        self._control: Any = None
        save_group: Any = None
        if self._distributed:
            import torch.distributed as dist

            # Made by every rank together, in the same order: gloo, so that neither the
            # stop agreement nor a background save shares training's communicator.
            self._control = dist.new_group(backend="gloo")
            if options.background:
                save_group = dist.new_group(backend="gloo")
        self._held = self._hold()  # one run per directory (rank 0 holds it)
        self._writer = Writer(
            self.directory,
            rank=self._rank,
            keep=options.keep,
            background=options.background,
            group=save_group,
            distributed=self._distributed,
            protect=self._protected,
            safe_globals=options.safe_globals,
        )
        self._announce = announcer
        self._signals = SignalWatch(options.preemption)
        self._stop = StopAgreement(self._control, options.preemption)
        self._position = Position()
        self._epoch_rng: dict[str, Any] | None = None
        self._skip = 0
        self._checked_total = -1
        self._saved_total = -1
        self._saved_windows = 0
        self._requested = False
        self._resumed = False
        self._closed = False
        # The batch batches() yielded, counted there, while its loop body runs (else None).
        self._yielded: Yielded | None = None
        #: The checkpoint this run resumed from (None: a fresh start).
        self.resumed_from: Path | None = None
        _OPEN.add(self)

    def _hold(self) -> lock.Held | None:
        """Take the directory's lock on rank 0; every rank raises if another run holds it."""
        held, refused = None, None
        if self._rank == 0:
            try:
                held = lock.hold(self.directory)
            except CheckpointSaveError as exc:
                refused = str(exc)
        if self._distributed:
            import torch.distributed as dist

            box: list[Any] = [refused]
            dist.broadcast_object_list(box, src=0, group=self._control)
            refused = box[0]
        if refused is not None:
            raise CheckpointSaveError(refused)
        if held is not None:
            weakref.finalize(self, held.release)  # (a Checkpointer dropped unclosed)
        return held

    # ------------------------------------------------------------------ state

    @property
    def position(self) -> Position:
        """Where the run stands: epoch, batches of it consumed, totals (see :class:`Position`)."""
        return self._position

    @property
    def latest(self) -> Path | None:
        """The newest complete checkpoint in :attr:`directory` (None when there is none)."""
        latest = layout.list_checkpoints(self.directory).latest
        return latest[0] if latest is not None else None

    @property
    def stop_requested(self) -> bool:
        """Whether this process received a watched stop signal (see ``preemption=``)."""
        return self._signals.signum is not None

    def __repr__(self) -> str:
        return (
            f"Checkpointer({str(self.directory)!r}, position={self._position}, "
            f"keep={self.keep}, every={self.every}, resumed_from={self.resumed_from})"
        )

    def _protected(self) -> list[Path]:
        # The checkpoint this run resumed from stays until one of its own is complete.
        if self.resumed_from is not None and self._writer.last is None:
            return [self.resumed_from]
        return []

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
        if self._resumed:
            return self._position
        path: Path | None = None
        cleared: list[Path] = []
        drain_background()  # an abandoned save of this process must not write on
        if self._rank == 0:
            cleared = layout.remove_stale_partials(self.directory)
            path = find_latest(self.directory)
        path = self._agree(path)
        self._resumed = True
        while path is not None:
            try:
                position = self.load(path)
            except reader.RefusedCheckpointError as exc:  # maybe tampered: the one before
                warnings.warn(f"cudakit: skipping checkpoint {path}: {exc}", UserWarning, 2)
            else:
                self._announce.resumed(path, position, cleared)
                return position
            path = self._agree(reader.written_before(self.directory, path))
        self._announce.resumed(None, self._position, cleared)
        return self._position

    def _refuse_unresumed(self) -> None:
        """A loop with its own data that never resumed: fine in an empty directory only
        (loading now would overwrite the step that just ran)."""
        path = find_latest(self.directory) if self._rank == 0 else None
        path = self._agree(path)
        if path is not None:
            raise RuntimeError(
                f"Checkpointer.maybe_save() before resume(): {self.directory} holds {path}, "
                "which this run has not loaded, and loading it now would overwrite the step "
                "that just ran. Call ckpt.resume() once before the loop (it loads the newest "
                "checkpoint and returns the position to continue from), or use a new "
                "directory."
            )
        self._resumed = True  # nothing to resume: the run starts here

    def _agree(self, path: Path | None) -> Path | None:
        if not self._distributed:
            return path
        import torch.distributed as dist

        box: list[Any] = [str(path) if path is not None else None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return Path(box[0]) if box[0] is not None else None

    def load(self, path: str | os.PathLike[str]) -> Position:
        """Load one checkpoint into the models, optimizers, step, schedulers, RNG and data.

        Everything is checked before anything changes: the manifest and every file's
        size, the number of models, optimizers, schedulers and steps, the tensors'
        names and shapes, and the world size where the data position depends on it.

        Returns:
            The position the checkpoint was taken at.

        Raises:
            CheckpointError: a corrupted or incomplete checkpoint, or one that does not
                fit (missing and unexpected keys, another optimizer count, a mid-epoch
                data position at another world size), naming what differs; a file that
                holds what the safe loader refuses, naming it and the refused global.
        """
        self._check_open("load")
        root = arguments.resolve_directory("Checkpointer.load", path)
        host, manifest = reader.read(
            root,
            self._parts,
            self._rank,
            self._world,
            self._distributed,
            extras=self.extra,
            loader=self.loader,
            group=self._control,
            trust=self._options.trust_pickles,
            safe_globals=self._options.safe_globals,
        )
        self._epoch_rng = reader.apply_host(host, manifest, loader=self.loader, rank=self._rank)
        pos = Position(**host["position"])
        self._position = pos
        loader = self.loader
        self._skip = pos.batch if loader is not None and not is_stateful(loader) else 0
        self._checked_total = self._saved_total = pos.total
        self._saved_windows = pos.windows
        self.resumed_from = root
        self._resumed = True
        log.info("cudakit: resumed from %s at %s", root, self._position)
        return self._position

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
        while self._position.epoch < stop:
            epoch = self._position.epoch
            yield epoch
            pos = self._position
            if pos.epoch == epoch:  # the epoch's data came from the user's own loop
                self._position = dataclasses.replace(pos, epoch=epoch + 1, batch=0)
            self._boundary()
        if self._position.total != self._saved_total and self._at_window_end():
            self.save()
        self.wait()
        if self._position.total != self._saved_total:  # the last window is open
            warn_open_window(self._parts.steps, self.latest)

    def batches(self, loader: Any = None) -> Iterator[Any]:
        """Yield this epoch's batches from ``loader`` (default: the one passed at creation).

        A resumed run skips the batches its epoch already consumed, with the same order
        and RNG as the run that saved. Between batches, after the step has run, it saves
        when due and reacts to a stop signal.
        """
        return self._batches(arguments.batches_loader(loader, self.loader))

    def _batches(self, loader: Any) -> Iterator[Any]:
        self.resume()
        start = self._position
        stateful = is_stateful(loader)
        gens = generators_of(loader)
        if not stateful:
            set_epoch(loader, start.epoch)
        skip, self._skip = self._skip, 0
        if skip and self._epoch_rng is not None:
            now = capture_rng(gens)
            restore_rng(self._epoch_rng, gens)
            iterator = iter(loader)
            skip_batches(iterator, skip)
            restore_rng(now, gens)
        else:
            self._epoch_rng = None if stateful else capture_rng(gens)
            iterator = iter(loader)
            if skip:
                skip_batches(iterator, skip)
        length, token = loader_length(loader), object()
        try:
            for batch, before in fetched(iterator, rng=not stateful):
                pos = self._position
                self._position = dataclasses.replace(pos, batch=pos.batch + 1, total=pos.total + 1)
                marks = step_marks(self._parts.steps)
                self._yielded = Yielded(self._position.total, marks, before, stateful, token)
                yield batch
                self._yielded = None
                if length is None or self._position.batch < length:
                    # (The last batch's save point is the epoch's end, as (epoch + 1, 0),
                    # once the iterator is exhausted: a sampler may still draw from the RNG.)
                    self._boundary()
        finally:  # (a generator closed late leaves a newer one's batch as it is)
            if self._yielded is not None and self._yielded.owner is token:
                self._yielded = None
        pos = self._position
        self._position = dataclasses.replace(pos, epoch=start.epoch + 1, batch=0)
        self._boundary()

    def maybe_save(self) -> Path | None:
        """Count one batch, and save if one is due (``every``, a request, a stop signal)
        at a window's end.

        Call it after each call of the step (each micro-batch), on every rank, when the
        loop brings its own data instead of :meth:`batches` (which counts the batches
        and checks between them itself: inside it, this only checks; close a batches()
        generator you leave). Returns the checkpoint's path when it saved.
        """
        self._check_open("maybe_save")
        if self._yielded is None:  # (inside batches(), which counted its batch: a check)
            if not self._resumed:
                self._refuse_unresumed()
            pos = self._position
            self._position = dataclasses.replace(pos, batch=pos.batch + 1, total=pos.total + 1)
        return self._boundary()

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
        if not self._at_window_end():
            self._requested = True
            return None
        if self._before_step():  # (a position saved already is not written again)
            done = self._position.total - 1 == self._saved_total
            return self._writer.newest if done else self._save_now(unconsumed=True)
        # A window that ended since the last boundary (a step, a flush()) is counted first.
        saved = self._boundary() if self._yielded is not None or self._parts.steps else None
        if saved is not None:
            return saved
        if self._yielded is None:  # a loop of its own: what the steps closed, or the saves
            self._position = progress.explicit_save(self._position, self._parts.steps)
        return self._save_now()

    def wait(self) -> Path | None:
        """Finish a background save in flight; returns its path (None: nothing was in flight)."""
        return self._writer.finish()

    def close(self) -> None:
        """Finish a background save, stop watching signals. Idempotent; also at exit."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        try:
            self._writer.finish()
        finally:
            self._stop.drain()
            self._signals.uninstall()
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

    def _at_window_end(self) -> bool:
        return all(s.position == 0 for s in self._parts.steps)

    def _boundary(self) -> Path | None:
        """At most once per batch: count the window, poll the stop flag, save if due."""
        pos = self._position
        if pos.total == self._checked_total or not self._at_window_end():
            return None
        self._checked_total = pos.total
        pos = dataclasses.replace(pos, windows=pos.windows + 1) if pos.batch or pos.total else pos
        self._position = pos
        if self._writer.pending is not None and self._writer.done():
            self._writer.finish()
        stop = self._stop.poll(self._signals.seen)
        due = self._requested or (
            self.every is not None and pos.windows - self._saved_windows >= self.every
        )
        saved = self._save_now() if (due or stop) and pos.total != self._saved_total else None
        if stop:
            self._exit_after_stop()
        return saved

    def _before_step(self) -> bool:
        """Whether no step ran a backward since batches() yielded its batch (a save at the
        top of the body); unknown without a step, or with a stateful loader (moved on)."""
        steps, now = self._parts.steps, self._yielded
        return (
            now is not None
            and bool(steps)
            and self._position.total == now.total
            and not now.stateful
            and all(map(operator.is_, step_marks(steps), now.marks))
        )

    def _save_now(self, unconsumed: bool = False) -> Path:
        """Save now; ``unconsumed``: without the batch just yielded, which a resume steps on."""
        pos = self._position
        if unconsumed:
            pos = dataclasses.replace(pos, batch=pos.batch - 1, total=pos.total - 1)
        name = layout.checkpoint_name(pos.windows)
        partial = self.directory / (name + layout.PARTIAL)
        final = self.directory / name
        parts = self._parts
        fresh = fresh_optimizers(parts)
        try:
            # The host state first: the steps' state settles a pending (sync-free) verdict,
            # which may put the schedulers and learning rates back, before they are read.
            host = self._host_state(fresh, pos, unconsumed)
            tensors = tensor_state(parts)
            fields = {
                "total": pos.total,
                "epoch": pos.epoch,
                "batch": pos.batch,
                "windows": pos.windows,
                "world_size": self._world,
                "models": tuple(parts.models),
                "optimizers": len(parts.optimizers),
                "schedulers": len(parts.schedulers),
                "steps": len(parts.steps),
                "mid_epoch_data": self.loader is not None and pos.batch > 0,
            }
            self._writer.write(tensors, host, Pending(partial, final, fields))
        finally:
            reset_fresh(parts, fresh)
        self._requested = False
        self._saved_total = pos.total
        self._saved_windows = pos.windows
        return final

    def _host_state(self, fresh: list[bool], pos: Position, unconsumed: bool) -> dict[str, Any]:
        loader = self.loader
        gens = generators_of(loader) if loader is not None else ()
        epoch_rng, now = self._epoch_rng, self._yielded
        if unconsumed and pos.batch == 0 and epoch_rng is not None:
            rng = epoch_rng  # before an epoch's first step: its start (its iterator drew then)
        else:
            rng = capture_rng(gens)
            if unconsumed and now is not None and now.rng is not None:
                rng["cpu"] = now.rng  # as the batch was fetched (augmentation)
        return {
            "format": layout.HOST_FORMAT,
            "rank": self._rank,
            "world_size": self._world,
            "position": dataclasses.asdict(pos),
            "rng": rng,
            "epoch_rng": self._epoch_rng if pos.batch > 0 else None,
            "steps": [s.state_dict() for s in self._parts.steps],
            "schedulers": [s.state_dict() for s in self._parts.schedulers],
            "fresh": fresh,
            "loader": loader.state_dict() if loader is not None and is_stateful(loader) else None,
            "extras": extras_state(self.extra),
        }

    def _exit_after_stop(self) -> None:
        self.wait()
        options = self._options
        code = after_stop(
            self._rank, self._stop.signals, self._signals, options.requeue, options.exit_code
        )
        log.warning(
            "cudakit: stop signal: saved %s, exiting with status %d", self._writer.last, code
        )
        self.close()
        raise SystemExit(code)


_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


@atexit.register
def _finish_at_exit() -> None:
    """Finish background saves still in flight when the interpreter exits."""
    for ckpt in list(_OPEN):
        try:
            ckpt.close()
        except Exception as exc:  # pragma: no cover - reported, never raised at exit
            log.error("cudakit: finishing %s at exit failed: %s", ckpt.directory, exc)
