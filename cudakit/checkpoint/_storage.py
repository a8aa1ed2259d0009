"""DCP's file-system writer, with each rank's files written once and made durable.

The files are DCP's own, byte for byte in layout: one ``__<rank>_0.distcp`` per rank,
its byte items first, then each tensor as a ``torch.save`` archive, at the offsets
DCP's ``FileSystemWriter`` gives them, indexed by DCP's ``.metadata``. What differs
is how they get there. DCP streams each archive through a Python wrapper, a call per
record; here small archives are gathered in memory and written in large pieces (a
tensor of :data:`DIRECT` bytes or more goes straight to the file, never copied), and
each small one is made from a template of its kind (:mod:`.archive`: the same bytes
``torch.save`` writes, without pickling again), so a small model's save is not
mostly per-tensor overhead.

As the data file is written, the disk is told to start writing what has been written
(Linux's ``sync_file_range``, every :data:`_PIECE` bytes): the fsync at the end then
waits for the last bytes only, and a large file's dirty pages do not pile up until the
kernel throttles the writer (a save of 1.2 GB took 15 % less on a CPU machine's disk).

``write_data`` also fsyncs the rank's host file (``rank-NNNNN.pt``, written before
DCP starts) right after its data file: it runs before DCP gathers every rank's
results, so once rank 0 writes the manifest, every rank's files are on disk.

Where DCP itself would write differently (tensors on a GPU, whose copies to the host
DCP overlaps with the writes; a torch whose internals moved), DCP's own ``write_data``
runs, then the host file is fsynced all the same.

A writer told to :meth:`defer` its writes (a background save of a small state in one
process) makes the bytes on the calling thread and keeps the writing and fsyncing
(``later``) for the background thread, whose work then releases the GIL almost all
the time: a thread running Python beside the loop would slow the loop's own Python.
"""

from __future__ import annotations

import ctypes
import functools
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ._archive import Archives
from ._plan import Plans

__all__ = ["DIRECT", "fsync_file", "storage_writer"]

#: Tensors of at least this many bytes are written straight into the file.
DIRECT = 1 << 20
_PIECE = 8 << 20  # bytes gathered before they are written
_IOV = 512  # pieces written by one writev (the system allows at least 1024)
_raw_file = io.FileIO  # the data file, unbuffered (the tests give one that writes less)
_START_WRITE = 2  # sync_file_range's SYNC_FILE_RANGE_WRITE: start writing, do not wait


def fsync_file(path: Path) -> None:
    """Make the file ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def storage_writer(path: Path, host_file: Path, *, on_host: bool, plans: Plans) -> Any:
    """DCP's ``FileSystemWriter`` for ``path`` (files fsynced), which also fsyncs
    ``host_file`` before every rank's results are gathered; ``on_host``: every tensor
    it writes is in host memory (then DCP's overlap of device copies has nothing to do);
    ``plans``: the saves' kept plans, whose ``.metadata`` pickle it reuses."""
    return _writer_class()(str(path), host_file, on_host, plans)


def _gpu_like() -> bool:
    """Whether DCP would overlap device copies with its writes (its own condition)."""
    if torch.cuda.is_available():
        return True
    name = torch._C._get_privateuse1_backend_name()
    module = getattr(torch, name, None)
    available = getattr(module, "is_available", None)
    return bool(callable(available) and available())


@functools.cache
def _writer_class() -> type:
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    try:
        from torch.distributed.checkpoint.planner import WriteItemType
        from torch.distributed.checkpoint.storage import WriteResult
        from torch.futures import Future

        suffix, info = fs.DEFAULT_SUFFIX, fs._StorageInfo
        torch_save = fs.SerializationFormat.TORCH_SAVE
        prefix_type = fs._StoragePrefix
        version, metadata_name = fs.CURRENT_DCP_VERSION, fs._metadata_fn
    except (ImportError, AttributeError):  # pragma: no cover - a torch that moved them
        suffix = None

    class Writer(FileSystemWriter):
        def __init__(self, path: str, host_file: Path, on_host: bool, plans: Plans) -> None:
            super().__init__(path, sync_files=True)
            self.host_file = host_file
            self.on_host = on_host
            self.plans = plans
            #: The file writes kept for later (None: each is done at once).
            self.later: list[Callable[[], None]] | None = None

        def defer(self) -> None:
            """Keep the files' writes and fsyncs for :attr:`later` from now on. The state
            written is then host buffers the caller keeps until they have run (a device
            state's copies: DCP's overlap of device copies has nothing to do)."""
            self.later = []
            self.on_host = True

        def _own_way(self, plan: Any) -> bool:
            """Whether this writer's layout is DCP's here (else DCP's own write_data)."""
            return (
                suffix is not None
                and self.single_file_per_rank
                and self.thread_count == 1
                and not getattr(self.transforms, "extensions", ())
                and getattr(self, "serialization_format", torch_save) == torch_save
                and isinstance(plan.storage_data, prefix_type)
                and (self.on_host or not _gpu_like())
            )

        def write_data(self, plan: Any, planner: Any) -> Any:
            if not self._own_way(plan):
                result = super().write_data(plan, planner)
                fsync_file(self.host_file)
                return result
            name = f"{plan.storage_data.prefix}0{suffix}"
            items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
            items += [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
            where = _write_file(Path(self.path) / name, items, planner, self.later)
            if self.later is None:
                fsync_file(self.host_file)
            else:
                self.later.append(functools.partial(fsync_file, self.host_file))
            results = [
                WriteResult(index=i.index, size_in_bytes=n, storage_data=info(name, at, n))
                for i, (at, n) in zip(items, where, strict=True)
            ]
            future: Any = Future()
            future.set_result(results)
            return future

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            """DCP's ``finish``, with the ``.metadata`` pickle the last save's where
            only its save id and directory name changed (:meth:`Plans.metadata_pickle`)."""
            if suffix is None or not self.use_collectives or not isinstance(self.path, Path):
                super().finish(metadata, results)
                return
            metadata.version = version
            metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
            metadata.storage_meta = self.storage_meta()
            data = self.plans.metadata_pickle(metadata)
            if self.later is None:
                self._write_metadata(data)
            else:
                self.later.append(functools.partial(self._write_metadata, data))

        def _write_metadata(self, data: bytes) -> None:
            tmp = self.fs.concat_path(self.path, f"{metadata_name}.tmp")
            with self.fs.create_stream(tmp, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            final = self.fs.concat_path(self.path, metadata_name)
            if self.fs.exists(final):
                self.fs.rm_file(final)
            self.fs.rename(tmp, final)

    return Writer


def _write_file(
    path: Path, items: list[Any], planner: Any, later: list[Callable[[], None]] | None = None
) -> list[tuple[int, int]]:
    """Write DCP's ``items`` (byte items first) into ``path``, fsynced; returns each
    item's offset and length. With ``later``, the bytes are made here and their writing
    is appended to it (the items' data must then stay as it is until it has run)."""
    if later is not None:
        pieces = _Pieces(None)
        where = _fill(pieces, items, planner)
        later.append(functools.partial(_write_pieces, path, pieces))
        return where
    with _raw_file(path, "wb") as file:
        pieces = _Pieces(file)
        where = _fill(pieces, items, planner)
        pieces.flush()
        os.fsync(file.fileno())
    return where


def _fill(pieces: _Pieces, items: list[Any], planner: Any) -> list[tuple[int, int]]:
    """Put each item's bytes into ``pieces`` (a tensor of :data:`DIRECT` bytes or more
    straight into their file, if they have one yet); returns each item's place."""
    from torch.distributed.checkpoint.planner import WriteItemType

    file = pieces.file
    where = []
    archives = Archives()
    offset = 0
    for item in items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            size = pieces.add((data.getbuffer(),), data)
        else:
            tensor = _on_host(data)
            if file is not None and tensor.nbytes >= DIRECT:
                pieces.flush()
                # Buffered: torch.save writes a tensor's bytes in one call, and one
                # system call writes at most 2 GiB; the buffer finishes what it cut.
                buffered = io.BufferedWriter(file)
                torch.save(tensor, buffered)
                buffered.flush()
                buffered.detach()
                size = file.tell() - offset
                pieces.write_back(offset + size)
            else:
                size = pieces.add(archives.pieces(tensor), tensor)
        where.append((offset, size))
        offset += size
    return where


def _write_pieces(path: Path, pieces: _Pieces) -> None:
    """Write gathered ``pieces`` into a new file ``path``, fsynced."""
    with _raw_file(path, "wb") as file:
        pieces.file = file
        pieces.flush()
        os.fsync(file.fileno())


class _Pieces:
    """Pieces of a file gathered, then written with one ``writev`` per :data:`_IOV`
    pieces (or :data:`_PIECE` bytes): no copy of them into a buffer first. The disk is
    told to start writing each :data:`_PIECE` bytes once they are written."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.pieces: list[memoryview] = []
        self.owners: list[Any] = []  # what the pieces are views of, kept until written
        self.size = 0
        self.written = 0  # the file's bytes written
        self.started: int | None = 0  # of those, the bytes the disk is writing (None: off)

    def add(self, pieces: tuple[Any, ...], owner: Any) -> int:
        """Gather ``pieces`` (views into ``owner``); returns their bytes. What is gathered
        is written once it is :data:`_IOV` pieces or :data:`_PIECE` bytes, if there is a
        file yet (else it is all kept for :func:`_write_pieces`)."""
        size = 0
        for piece in pieces:
            view = memoryview(piece).cast("B")
            if view.nbytes:
                self.pieces.append(view)
                size += view.nbytes
        self.owners.append(owner)
        self.size += size
        if self.file is not None and (len(self.pieces) >= _IOV or self.size >= _PIECE):
            self.flush()
        return size

    def flush(self) -> None:
        """Write what is gathered, whole (a short write goes on from where it stopped)."""
        pieces = self.pieces
        fd = self.file.fileno()
        first = 0
        while first < len(pieces):
            written = os.writev(fd, pieces[first : first + _IOV])
            if written <= 0:
                raise OSError(f"writing {self.file.name} wrote nothing")
            self.write_back(self.written + written)
            while first < len(pieces) and written >= pieces[first].nbytes:
                written -= pieces[first].nbytes
                first += 1
            if written:
                pieces[first] = pieces[first][written:]
        pieces.clear()
        self.owners.clear()
        self.size = 0

    def write_back(self, written: int) -> None:
        """The file's first ``written`` bytes are written: once :data:`_PIECE` bytes wait,
        tell the disk to start writing them, where the system can (Linux); where it
        refuses, the fsync at the end writes them all."""
        self.written = written
        start = _sync_file_range()
        if start is None or self.started is None or written - self.started < _PIECE:
            return
        failed = start(self.file.fileno(), self.started, written - self.started, _START_WRITE)
        self.started = None if failed else written


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range``, or None where there is none (not Linux)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError, TypeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _on_host(data: torch.Tensor) -> torch.Tensor:
    """The tensor as DCP writes it: detached, in host memory, with no storage beyond it."""
    tensor = data.detach().cpu()
    if tensor.untyped_storage().size() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor
