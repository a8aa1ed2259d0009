"""Reading DCP's files through the allowlists: the safe storage reader and load planner.

DCP reads its ``.metadata`` with a plain ``pickle.load``, and the values it keeps as
pickled bytes inside its data files (optimizer hyper-parameters, a module's extra
state) with ``torch.load(weights_only=False)``; here the first goes through
:class:`_MetadataUnpickler` (DCP's own metadata classes, ``torch.Size``, dtypes,
layouts, devices, paths and builtin containers), the second through torch's safe
loader (:func:`safe_planner`), with the host files' allowlist
(:mod:`~cudakit.checkpoint._safe_load`). Tensors are ``torch.load(weights_only=True)``'s,
one archive of each layout (:mod:`~cudakit.checkpoint._unarchive`). What either
refuses is a :class:`~cudakit.checkpoint._safe_load.RefusedCheckpointError` naming the
file and the refused global, raised before that global is looked up.

:func:`dcp_reader` and :func:`dcp_load` are the one way cudakit reads DCP; the planner
also reads the tensors a load names ``fresh`` into new storage, so that a failed load
finds them untouched. ``trust=True`` reads with pickle's full loader instead.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from ..exceptions import CheckpointError
from ._safe_load import allowed_globals, pickle_of_bytes, refusal_error, refusal_reason
from ._unarchive import TensorReader

__all__ = ["DataFileError", "dcp_load", "dcp_reader", "safe_planner"]

_FUNC = "Checkpointer.load()"


class DataFileError(Exception):
    """A DCP data file whose record could not be read (named: DCP's own error does not)."""


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What DCP's ``.metadata`` may name: DCP's own classes, torch's value types, paths."""
    import builtins
    import collections
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {}
    meta = "torch.distributed.checkpoint.metadata"
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ):
        allowed[meta, name] = getattr(metadata, name)
    allowed["torch.distributed.checkpoint.filesystem", "_StorageInfo"] = filesystem._StorageInfo
    allowed["torch", "Size"] = torch.Size
    allowed["torch", "device"] = torch.device
    allowed["torch.serialization", "_get_layout"] = torch.serialization._get_layout
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            allowed["torch", name] = value
    allowed["collections", "OrderedDict"] = collections.OrderedDict
    for name in ("set", "frozenset", "complex"):
        allowed["builtins", name] = getattr(builtins, name)
    paths = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
    for name in paths:
        cls = getattr(pathlib, name)
        allowed["pathlib", name] = cls
        allowed[cls.__module__, name] = cls  # pathlib._local on Python 3.13
    return allowed


_METADATA_GLOBALS: list[dict[tuple[str, str], Any]] = []


class _Refused(pickle.UnpicklingError):
    """A global outside the allowlist (raised by :class:`_MetadataUnpickler`)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that looks up only the globals DCP's metadata holds.

    Every way a pickle reaches a callable (``GLOBAL``, ``STACK_GLOBAL``, ``INST``, the
    extension registry) goes through :meth:`find_class`; a name it refuses is never
    imported, so nothing of it runs.
    """

    def find_class(self, module: str, name: str) -> Any:
        if not _METADATA_GLOBALS:
            _METADATA_GLOBALS.append(_metadata_globals())
        found = _METADATA_GLOBALS[0].get((module, name))
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"a persistent id ({type(pid).__name__})")


def _dcp_reader_class() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's ``FileSystemReader`` whose metadata goes through the allowlist."""

        def __init__(self, path: str, trust: bool = False) -> None:
            super().__init__(path)
            #: The data file being read (for messages).
            self.current: str | None = None
            self.trust = trust
            self._metadata: Any = None  # read once: by the checks, then by DCP's load
            #: Reads the tensors' archives (and those left to be read in place later).
            self.tensors = TensorReader()

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self._metadata is None or kwargs.get("rank") is not None:
                self._metadata = self._read_metadata(kwargs.get("rank"))
            return self._metadata

        def _read_metadata(self, rank: int | None) -> Any:
            file = self._get_metadata_path(rank)
            if self.trust:
                return super().read_metadata(rank=rank)
            with self.fs.create_stream(file, "rb") as stream:
                try:
                    metadata = _MetadataUnpickler(stream).load()
                except _Refused as exc:
                    where = Path(file)
                    raise refusal_error(
                        where, [exc.name], "DCP's metadata allowlist", False
                    ) from None
            if not (
                isinstance(metadata, Metadata)
                and isinstance(metadata.state_dict_metadata, dict)
                and isinstance(metadata.storage_data, dict)
                and isinstance(metadata.storage_meta, StorageMeta | None)
            ):
                raise CheckpointError(
                    f"{_FUNC}: {file} holds {type(metadata).__name__}, not DCP's metadata; "
                    "the checkpoint is corrupted."
                )
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
            self.current = str(getattr(sinfo, "relative_path", None) or "") or None
            return super()._slice_file(file, sinfo)

        def read_data(self, plan: Any, planner: Any) -> Any:
            """DCP's ``read_data``, except that a tensor read for a fresh tensor is
            handed to the planner (:meth:`Planner.take`) instead of copied into the
            state dict's own tensor."""
            from torch.distributed.checkpoint.planner import LoadItemType

            take = getattr(planner, "take", None)
            in_place = getattr(planner, "in_place", None)
            tensors = self.tensors
            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, [])
                per_file[self.storage_data[item.storage_index].relative_path].append(item)
            for relative_path, reqs in per_file.items():
                path = self.fs.concat_path(self.path, relative_path)
                with self.fs.create_stream(path, "rb") as stream:
                    for req in reqs:
                        info = self.storage_data[req.storage_index]
                        view = self.transforms.transform_load_stream(
                            req, info.transform_descriptors or (), self._slice_file(stream, info)
                        )
                        if req.type == LoadItemType.BYTE_IO:
                            planner.load_bytes(req, io.BytesIO(view.read(-1)))
                            continue
                        raw = not info.transform_descriptors  # (the file's own bytes)
                        target = in_place(req) if in_place is not None and raw else None
                        if target is not None and tensors.defer(
                            view, info.length, target, str(path), info.offset
                        ):
                            continue
                        loaded = tensors.read(view, info.length)
                        if take is not None and take(req, loaded):
                            continue
                        part = _narrow(loaded, req.storage_offsets, req.lengths)
                        target = planner.resolve_tensor(req).detach()
                        if target.size() != part.size():
                            raise ValueError(
                                f"{req.storage_index.fqn} holds a chunk of shape "
                                f"{tuple(part.size())} where {tuple(target.size())} was expected"
                            )
                        target.copy_(part)
                        planner.commit_tensor(req, target)
            done: torch.futures.Future[None] = torch.futures.Future()
            done.set_result(None)
            return done

    return SafeReader


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's own data: a DTensor's local shard, else the tensor."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


def _like(target: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``target`` is: a DTensor of the same mesh, placements, shape and
    strides over it where ``target`` is one, else ``local`` itself."""
    if getattr(target, "to_local", None) is None:
        return local
    from torch.distributed.tensor import DTensor

    like: torch.Tensor = DTensor.from_local(
        local,
        target.device_mesh,  # type: ignore[attr-defined]
        target.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=target.shape,
        stride=target.stride(),
    )
    return like


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    from torch.distributed._shard._utils import narrow_tensor_by_index

    out: torch.Tensor = narrow_tensor_by_index(tensor, offsets, lengths)
    return out


_READER: list[type] = []


def dcp_reader(root: Path, *, trust: bool = False) -> Any:
    """The storage reader of every DCP load in cudakit: DCP's ``FileSystemReader``, its
    ``.metadata`` read through the allowlist (``trust``: DCP's own, plain pickle)."""
    if not _READER:
        _READER.append(_dcp_reader_class())
    return _READER[0](str(root), trust=trust)


def _planner_class() -> type:
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        """DCP's default load planner, reading pickled values with the safe loader
        (``trust``: with pickle's full loader), and loading the tensors named in
        ``fresh`` into new storage instead of into themselves (:meth:`take`)."""

        def __init__(
            self,
            reader: Any,
            safe_globals: Sequence[Any],
            fresh: Collection[int],
            later: Collection[int],
            trust: bool,
        ) -> None:
            super().__init__()
            self.reader = reader
            self.user_globals = tuple(safe_globals)
            self.fresh = fresh  # ids of the state dict's tensors to leave untouched
            self.later = later  # ids of those the reader may fill in place later
            self.trust = trust
            self.taken: dict[str, torch.Tensor] = {}  # each fresh tensor's new storage

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            if self.trust:
                super().load_bytes(read_item, value)
                return
            try:
                with allowed_globals(self.user_globals), warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*pickle protocol")
                    obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                file = getattr(self.reader, "current", None) or "a data file"
                refused = refusal_reason(exc, pickle_of_bytes(value))
                what = f"torch.load(weights_only=True), value {read_item.dest_index.fqn}"
                raise refusal_error(file, refused, what) from None
            self._put(read_item.dest_index.fqn, obj)

        def _put(self, fqn: str, obj: Any) -> None:
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.original_state_dict[fqn] = obj
            self.state_dict[fqn] = obj

        def in_place(self, read_item: Any) -> torch.Tensor | None:
            """The memory to read a tensor into later, in place (its reader's
            ``read_later``): a tensor named in ``later`` read whole, else None."""
            target = self.state_dict.get(read_item.dest_index.fqn)
            if not isinstance(target, torch.Tensor) or id(target) not in self.later:
                return None
            local = _local(target)
            if (
                any(read_item.dest_offsets)
                or any(read_item.storage_offsets)
                or list(read_item.lengths) != list(local.size())
            ):
                return None
            return local

        def take(self, read_item: Any, loaded: torch.Tensor) -> bool:
            """Load a chunk of a fresh tensor into new storage: the chunk itself where it
            is the whole tensor (a DTensor's: its local shard), else a new tensor it is
            copied into. False: the tensor is loaded in place (DCP's way)."""
            fqn = read_item.dest_index.fqn
            new = self.taken.get(fqn)
            target = self.state_dict.get(fqn)
            fresh = new is not None or id(target) in self.fresh
            if not fresh or not isinstance(target, torch.Tensor):
                return False
            local = _local(target)
            lengths = list(read_item.lengths)
            whole = (
                new is None
                and list(local.size()) == lengths == list(loaded.size())
                and loaded.dtype == local.dtype
                and not any(read_item.dest_offsets)
                and not any(read_item.storage_offsets)
            )
            first = new is None
            if whole:
                new = loaded
            else:
                if new is None:
                    new = torch.empty_like(local)
                part = _narrow(loaded, read_item.storage_offsets, lengths)
                _narrow(new, read_item.dest_offsets, lengths).copy_(part)
            self.taken[fqn] = new
            if first:
                self._put(fqn, _like(target, new))
            return True

    return Planner


_PLANNER: list[type] = []


def safe_planner(
    reader: Any,
    safe_globals: Sequence[Any] = (),
    *,
    fresh: Collection[int] = (),
    later: Collection[int] = (),
    trust: bool = False,
) -> Any:
    """DCP's ``DefaultLoadPlanner``, its pickled values read with torch's safe loader
    (``trust``: pickle's full loader), the tensors whose ids are in ``fresh`` loaded into
    new storage: the state dict then holds the new tensors, and those it held before
    are left as they were. Of those, the ids in ``later`` may instead be left for the
    reader's ``read_later`` to read into their own memory."""
    if not _PLANNER:
        _PLANNER.append(_planner_class())
    return _PLANNER[0](reader, safe_globals, fresh, later, trust)


def dcp_load(
    state: dict[str, Any],
    root: Path,
    *,
    distributed: bool,
    trust: bool = False,
    safe_globals: Sequence[Any] = (),
    reader: Any = None,
    fresh: Collection[int] = (),
    later: Collection[int] = (),
) -> None:
    """DCP's ``load`` of ``state`` from ``root``, through the safe reader and planner: in
    place, except the tensors whose ids are in ``fresh``, which ``state`` then holds new
    (CPU) tensors for, and which are left untouched; of those, the ones in ``later``
    whose archives fit are left, untouched, for ``reader.tensors.read_later()``.

    Raises:
        RefusedCheckpointError: a file holds a global the allowlists refuse.
        CheckpointError: a data file that cannot be read (naming it where known).
        BaseException: DCP's own failures otherwise (its ``CheckpointException``).
    """
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = reader if reader is not None else dcp_reader(root, trust=trust)
    kwargs: dict[str, Any] = {} if distributed else {"no_dist": True}
    kwargs["planner"] = safe_planner(reader, safe_globals, fresh=fresh, later=later, trust=trust)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        warnings.filterwarnings("ignore", message=".*pickle protocol")
        try:
            load(state, storage_reader=reader, **kwargs)
        except BaseException as exc:
            inner = _inner(exc)
            if isinstance(inner, CheckpointError):
                raise inner from None
            file = getattr(reader, "current", None)
            if isinstance(inner, pickle.UnpicklingError):
                raise refusal_error(
                    root / (file or "a data file"),
                    refusal_reason(inner, b""),
                    "torch.load(weights_only=True)",
                ) from None
            if file is not None and isinstance(inner, Exception):
                raise DataFileError(
                    f"{file} cannot be read ({type(inner).__name__}: {inner})"
                ) from exc
            raise


def _inner(exc: BaseException) -> BaseException:
    """The first rank's error inside DCP's ``CheckpointException``, else ``exc``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return inner
    return exc
