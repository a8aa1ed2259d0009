"""Writing a checkpoint: synchronously, or in the background with at most one in flight.

Every rank writes its host file into the ``.partial`` directory, then calls DCP's
``save`` (or ``async_save``), whose first collective (planning) cannot finish before
every rank has arrived, and each rank fsyncs its files before DCP gathers the ranks
(:mod:`~cudakit.checkpoint._storage`): so once DCP has written its ``.metadata`` on rank
0, every rank's files are on disk. Rank 0 then writes the manifest and renames the
directory (:func:`~cudakit.checkpoint._layout.write_manifest`), and removes old
checkpoints (their files on the background thread).

Background saves run DCP's ``async_save`` on a gloo group of their own (made once,
by every rank together), so the save's collectives never interleave with training's.
The loop waits only while DCP stages the state (a copy in host memory). In one process,
a small state's bytes are made on the loop too, and the thread only writes and fsyncs
them (the storage writer's ``defer()``): a thread running Python beside the loop takes
the GIL from the loop's own Python, a cost larger than the save's. That thread also
removes the checkpoints ``keep=`` lets go, once it has published the new one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import logging
import os
import pickle
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

import torch

from ..exceptions import CheckpointSaveError
from . import _admit as admit
from . import _failures as failures
from . import _layout as layout
from . import _plan as plan
from . import _safe_load as safe_load
from ._state import failure_cause
from ._storage import storage_writer

__all__ = ["Pending", "Writer", "drain_background"]

log = logging.getLogger("cudakit.checkpoint")


@dataclasses.dataclass
class Pending:
    """A save whose files are being written: finished by :meth:`Writer.finish`."""

    partial: Path
    final: Path
    fields: dict[str, Any]
    future: Future[Any] | None = None
    #: The directory's checkpoints once the future wrote the manifest and renamed the
    #: directory visible (None: not yet).
    published: layout.Found | None = None
    #: Whether the thread also removed what ``keep=`` lets go, once it published.
    pruned: bool = False
    #: Set by the loop once it has copied the state into the host buffers (``copied``:
    #: it all was); the future publishes only a whole copy.
    staged: threading.Event = dataclasses.field(default_factory=threading.Event)
    copied: bool = False


class Writer:
    """Writes checkpoints into ``root`` and keeps the ``keep`` newest complete ones."""

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        keep: int | None,
        background: bool,
        group: Any,
        distributed: bool,
        protect: Callable[[], list[Path]],
        safe_globals: tuple[Any, ...] = (),
    ) -> None:
        self.root = root
        self.safe_globals = safe_globals  # the user's types the safe loader admits
        self.rank = rank
        self.keep = keep
        self.background = background
        self.group = group  # the process group DCP uses (None: the default, or no group)
        self.distributed = distributed
        self._protect = protect
        self.pending: Pending | None = None
        self._staging: dict[str, torch.Tensor] = {}  # reused host buffers of background saves
        self._plans = plan.Plans()  # DCP's plan, kept while the state keeps its shape
        #: The newest checkpoint this writer completed.
        self.last: Path | None = None

    def write(self, tensors: dict[str, Any], host: dict[str, Any], pending: Pending) -> None:
        """Write (or start writing) one checkpoint; a background save already running is
        finished first, so at most one is ever in flight."""
        self.finish()
        drain_background()  # a save an abandoned Checkpointer left running, writing here
        try:
            pending.partial.mkdir(parents=True, exist_ok=True)
            try:
                file = pending.partial / layout.rank_file(self.rank)
                torch.save(host, file)
                admit.check_saved(file, host, tensors, self.safe_globals)
            except (TypeError, AttributeError, pickle.PicklingError, safe_load.Unloadable) as exc:
                self._failed(pending, exc, _unpicklable(host, exc, self.safe_globals))
            writer = storage_writer(
                pending.partial, file, on_host=_on_host(tensors), plans=self._plans
            )
            if not self.background:
                self._save(tensors, writer)
            elif self.distributed:
                from torch.distributed.checkpoint.state_dict_saver import async_save

                result: Any = async_save(
                    tensors,
                    storage_writer=writer,
                    planner=plan.planner(self._plans),
                    process_group=self.group,
                )
                pending.future = getattr(result, "upload_completion", result)
            else:
                # DCP writes each tensor as soon as it is copied: the loop waits for the
                # copy, the save finishes about when the last tensor is written, and is
                # made visible there too (the manifest's and the renames' fsyncs).
                # A small state is copied whole first: waiting per tensor costs more.
                staged, copies = _staged(tensors, self._staging)
                events: list[threading.Event] | None = None
                if sum(buf.nbytes for _, buf in copies) <= COPY_FIRST:
                    # A small state: its bytes are made here, and the thread only writes
                    # and fsyncs them (Python there would slow the loop's own).
                    for src, buf in copies:
                        buf.copy_(src)
                    pending.copied = True
                    pending.staged.set()
                    writer.defer()
                    self._save(staged, writer)
                    pending.future = _executor().submit(self._write_later, writer.later, pending)
                else:
                    events = [threading.Event() for _ in copies]
                    planner = _waiting_planner(copies, events, self._plans)
                    pending.future = _executor().submit(
                        self._save_and_publish, staged, writer, planner, pending
                    )
                if events is not None:
                    try:
                        _copy_all(copies, events)
                        pending.copied = True
                    finally:
                        pending.staged.set()  # (not copied: the future publishes nothing)
        except BaseException as exc:
            if isinstance(pending.future, Future):
                concurrent.futures.wait([pending.future])  # before the partial goes
            self._failed(pending, exc)
        self.pending = pending
        if not self.background:
            self.finish()

    def _save(self, tensors: dict[str, Any], writer: Any, planner: Any = None) -> None:
        """DCP's save; in one process through its inner function, which does not warn that
        no process group runs (a warning in a background thread cannot be filtered)."""
        from torch.distributed.checkpoint import state_dict_saver

        inner = getattr(state_dict_saver, "_save_state_dict", None)
        if planner is None:
            planner = plan.planner(self._plans)
        if self.distributed:
            state_dict_saver.save(
                tensors, storage_writer=writer, planner=planner, process_group=self.group
            )
        elif inner is not None:
            inner(state_dict=tensors, storage_writer=writer, no_dist=True, planner=planner)
        else:  # pragma: no cover - a torch without the inner function
            state_dict_saver.save(tensors, storage_writer=writer, no_dist=True, planner=planner)

    def _save_and_publish(
        self, tensors: dict[str, Any], writer: Any, planner: Any, pending: Pending
    ) -> None:
        """A single-process background save, whole: DCP's save, then the manifest once
        the loop's copy into the host buffers is known to be whole."""
        self._save(tensors, writer, planner)
        pending.staged.wait()
        if pending.copied:
            self._publish(pending)

    def _write_later(self, later: list[Callable[[], None]], pending: Pending) -> None:
        """A small single-process background save's writes, in order, then its manifest."""
        for write in later:
            write()
        self._publish(pending)

    def _publish(self, pending: Pending) -> None:
        """On the thread of a single-process background save: the manifest and the
        rename, then the removals of ``keep=`` (the loop waits for neither)."""
        pending.published = layout.write_manifest(pending.partial, pending.final, pending.fields)
        self.prune(pending.published)
        pending.pruned = True

    def finish(self) -> Path | None:
        """Wait for the save in flight (if any), then make it visible; returns its path."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        if pending.future is not None:
            try:
                pending.future.result()
            except BaseException as exc:
                self._failed(pending, exc)
        if self.rank == 0:
            found = pending.published
            if found is None:
                try:
                    found = layout.write_manifest(pending.partial, pending.final, pending.fields)
                except OSError as exc:
                    self._failed(pending, exc)
            if not pending.pruned:
                self.prune(found)
        self.last = pending.final
        log.info("cudakit: checkpoint %s complete", pending.final)
        return pending.final

    @property
    def newest(self) -> Path | None:
        """The checkpoint written last: the one in flight, else the last finished."""
        return self.pending.final if self.pending is not None else self.last

    def done(self) -> bool:
        """Whether nothing is in flight, or the background save has finished writing."""
        return self.pending is None or (
            self.pending.future is not None and self.pending.future.done()
        )

    def prune(self, found: layout.Found) -> None:
        """Remove the old complete checkpoints ``keep=`` lets go (rank 0); ``found``: the
        directory as the save just published left it.

        Each is renamed out of the checkpoints' names, then its files are removed, before
        the call returns: a listing of the directory after a save shows ``keep`` of them.
        """
        if self.keep is None or self.rank != 0:
            return
        for path in layout.to_remove([p for p, _ in found.complete], self.keep, self._protect()):
            doomed = layout.set_aside(path)
            if isinstance(doomed, str):
                _removed(path, self.keep, doomed)
            else:
                _remove(path, doomed, self.keep)

    def _failed(self, pending: Pending, exc: BaseException, fix: str | None = None) -> NoReturn:
        if self.rank == 0:
            shutil.rmtree(pending.partial, ignore_errors=True)
        if isinstance(exc, KeyboardInterrupt | SystemExit | GeneratorExit | CheckpointSaveError):
            raise exc  # the partial is gone; the interruption (or a named failure) goes on
        # (DCP's CheckpointException derives from BaseException: it is a save failure.)
        latest = layout.list_checkpoints(self.root).latest
        kept = (
            f"The previous checkpoint {latest[0]} is intact and is what resume() loads."
            if latest is not None
            else "No earlier checkpoint exists in this directory."
        )
        fix = fix or failures.fix_for(exc, self.root)
        raise CheckpointSaveError(
            f"Checkpointer.save(): writing {pending.final} failed: {failure_cause(exc)}. "
            f"Nothing of it became visible. {kept} {fix}"
        ) from exc


def _on_host(tree: Any) -> bool:
    """Whether every tensor of a nested state dict is in host memory."""
    if isinstance(tree, torch.Tensor):
        return tree.device.type == "cpu"
    if isinstance(tree, dict):
        return all(_on_host(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return all(_on_host(v) for v in tree)
    return True


_Copy = tuple[torch.Tensor, torch.Tensor]  # (the source, its host buffer)

#: A background save in one process copies a state of at most this many bytes whole
#: before its thread writes; a larger one is written tensor by tensor as it is copied.
COPY_FIRST = 16 << 20


def _staged(tree: Any, cache: dict[str, torch.Tensor], path: str = "") -> tuple[Any, list[_Copy]]:
    """Host buffers for a nested state dict's tensors, and the copies to make into them
    (source, buffer); the rest as it is.

    The buffers are those of the previous save where shapes and dtypes match (at most
    one save is in flight, so they are free again): after the first save the loop waits
    for a memory copy only, not for the allocation and first touch of fresh pages.
    """
    copies: list[_Copy] = []

    def walk(tree: Any, path: str) -> Any:
        if isinstance(tree, torch.Tensor):
            src = tree.detach()
            buf = cache.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu")
                cache[path] = buf
            copies.append((src, buf))
            return buf
        if isinstance(tree, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in tree.items()}
        if isinstance(tree, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(tree)]
        return copy.deepcopy(tree)

    return walk(tree, path), copies


def _copy_all(copies: list[_Copy], events: list[threading.Event]) -> None:
    """Make the copies, each announced when done; all are announced even on a failure,
    so that the writing thread never waits for ever (it then writes what is there, and
    the save is failed by the error raised here)."""
    try:
        for (src, buf), done in zip(copies, events, strict=True):
            buf.copy_(src)
            done.set()
    finally:
        for done in events:
            done.set()


def _waiting_planner(copies: list[_Copy], events: list[threading.Event], plans: plan.Plans) -> Any:
    """The save planner, whose ``resolve_data`` waits until a tensor's copy has been
    made (:func:`_copy_all`) before DCP writes it."""
    waits = {id(buf): done for (_, buf), done in zip(copies, events, strict=True)}
    planner = plan.planner(plans)

    def resolve_data(write_item: Any) -> Any:
        found = planner.lookup_object(write_item.index)
        done = waits.get(id(found))
        if done is not None:
            done.wait()
        return planner.transform_object(write_item, found)

    planner.resolve_data = resolve_data
    return planner


def _remove(path: Path, doomed: Path, keep: int) -> None:
    _removed(path, keep, layout.remove_set_aside(doomed))


def _removed(path: Path, keep: int, failed: str | None) -> None:
    if failed is None:
        log.info("cudakit: removed old checkpoint %s (keep=%d)", path, keep)
    else:
        log.warning("cudakit: could not remove old checkpoint %s (keep=%d): %s", path, keep, failed)


_POOL: list[tuple[int, ThreadPoolExecutor]] = []


def drain_background() -> None:
    """Wait for everything this process started on the background thread (single-process
    background saves, the removals of ``keep=``), its errors ignored: a Checkpointer
    that raised without ``close()`` may have left a save running (a crashed process
    takes its thread along; an exception caught in the same process does not), and it
    must not write into a directory a new run uses."""
    if _POOL and _POOL[0][0] == os.getpid():
        with contextlib.suppress(RuntimeError):  # at exit: the thread has finished
            _POOL[0][1].submit(lambda: None).result()


def _executor() -> ThreadPoolExecutor:
    """The one background thread (made on first use, again in a forked child, which
    has no thread of its parent's)."""
    if not _POOL or _POOL[0][0] != os.getpid():
        _POOL[:] = [
            (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="cudakit-ckpt"))
        ]
    return _POOL[0][1]


def _unpicklable(host: dict[str, Any], exc: BaseException, safe_globals: tuple[Any, ...]) -> str:
    """What to do when a rank file's state cannot be pickled, or would not load with the
    safe loader: name the extras at fault."""
    bad, refused = [], []
    for name, (_, value) in host.get("extras", {}).items():
        try:
            pickle.dumps(value)
        except Exception as err:
            bad.append(f"{name!r} ({type(value).__name__}: {err})")
            continue
        names = admit.refused_in(value, safe_globals)
        if names:
            refused.append(f"{name!r} ({type(value).__name__}: {', '.join(names)})")
    allow = (
        "Allow a type of your own with Checkpointer(..., safe_globals=[TheType]) if you "
        "trust it, or save"
    )
    if bad:
        return (
            f"The extra(s) {', '.join(bad)} cannot be pickled: pass values that can (numbers, "
            "strings, lists, tensors) or objects with state_dict()/load_state_dict() whose "
            "state can, in Checkpointer(extra={...})."
        )
    if refused:
        return (
            f"The extra(s) {', '.join(refused)} would not load back with "
            f"torch.load(weights_only=True), which a resume uses so that a checkpoint "
            f"cannot run code. {allow} plain values (numbers, strings, lists, dicts, "
            "tensors, NumPy arrays) or objects with state_dict()/load_state_dict() whose "
            "state is such values."
        )
    if isinstance(exc, safe_load.Unloadable):
        return (
            f"The host state (step, scheduler or loader state) or the model state holds "
            f"what torch.load(weights_only=True) refuses: {exc}. {allow} plain values there."
        )
    return "The host state (RNG, step or scheduler state) cannot be pickled."
