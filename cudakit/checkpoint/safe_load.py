"""Reading a checkpoint without running anything its files hold.

A pickle can name any function of any module and call it while it loads (``os.system``,
``exec``): loading a file someone else could write hands them the process. So every
file of a checkpoint is read through an allowlist, and what it does not admit is a
:class:`RefusedCheckpointError` naming the file and the refused global, raised before
that global is looked up:

* each rank's host file (``rank-NNNNN.pt``) with torch's safe loader,
  ``torch.load(weights_only=True)``: tensors and plain containers, NumPy arrays of
  numbers, and the types the user allowed (``Checkpointer(safe_globals=[...])``);
* DCP's ``.metadata``, which DCP itself reads with a plain ``pickle.load``, with
  :class:`_MetadataUnpickler`: DCP's own metadata classes, ``torch.Size``, dtypes,
  layouts, devices, paths and builtin containers;
* the values DCP keeps as pickled bytes inside its data files (optimizer
  hyper-parameters, a module's extra state), which DCP's load planner reads with
  ``torch.load(weights_only=False)``, with torch's safe loader (:func:`safe_planner`);
  DCP reads tensors safely itself.

:func:`dcp_reader` and :func:`dcp_load` are the one way cudakit reads DCP; what it
saves is checked first (:mod:`~cudakit.checkpoint.admit`), so a value the safe loader
would refuse is refused at ``save()``, not found at resume. ``trust=True`` reads with pickle's full
loader instead: checkpoints written before host format 2 need it.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import io
import pickle
import pickletools
import re
import warnings
import zipfile
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from .._check import is_int
from ..exceptions import CheckpointError
from . import layout

__all__ = [
    "DataFileError",
    "RefusedCheckpointError",
    "Unloadable",
    "allowed_globals",
    "dcp_load",
    "dcp_reader",
    "load_host",
    "pickle_of",
    "pickle_of_bytes",
    "refusal_reason",
    "refused_globals",
    "safe_planner",
]

_FUNC = "Checkpointer.load()"


class RefusedCheckpointError(CheckpointError):
    """A checkpoint file holds something the safe loaders refuse: written by code that
    saved other types, or changed by someone. Nothing of it ran.

    Attributes:
        file: the file, relative to the checkpoint where that is known.
        refused: the refused globals (``posix.system``), or a description.
    """

    def __init__(self, message: str, *, file: str = "", refused: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.file = file
        self.refused = tuple(refused)


class DataFileError(Exception):
    """A DCP data file whose record could not be read (named: DCP's own error does not)."""


class Unloadable(Exception):
    """A value about to be saved that the safe loader would refuse (see ``admit.check_saved``)."""


# ---------------------------------------------------------------------------- allowlists


def _numpy_globals() -> list[Any]:
    """NumPy arrays and scalars of numbers, bools and strings (no object dtype)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        return []
    core = getattr(np, "_core", None) or np.core
    multiarray = core.multiarray
    found: list[Any] = [np.ndarray, np.dtype]
    for func in (multiarray._reconstruct, multiarray.scalar):
        # Files written by NumPy 1 name numpy.core, NumPy 2's numpy._core.
        found += [
            (func, f"numpy.core.multiarray.{func.__name__}"),
            (func, f"numpy._core.multiarray.{func.__name__}"),
        ]
    codes = "?bBhHiIlLqQefdgFDGSU"
    found += list({type(np.dtype(c)) for c in codes})
    return found


_NUMPY: list[list[Any]] = []


@contextlib.contextmanager
def allowed_globals(user: Sequence[Any] = ()) -> Iterator[None]:
    """torch's safe loader admits NumPy arrays of numbers and ``user``'s types meanwhile,
    and ``bytes``: pickle writes an empty ``b""`` as a call of it (torch admits
    ``bytearray`` alike)."""
    if not _NUMPY:
        _NUMPY.append(_numpy_globals())
    with torch.serialization.safe_globals([*_NUMPY[0], bytes, *user]):
        yield


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


# ---------------------------------------------------------------------------- messages


def refused_globals(data: bytes, allowed: Any = None) -> list[str]:
    """The globals a pickle names, read without running it (``pickletools``): all of
    them, or those ``allowed(name)`` refuses. Empty when the bytes cannot be parsed."""
    names: list[str] = []
    strings: list[str] = []
    memo: dict[int, Any] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST"):
                module, _, name = str(arg).partition(" ")
                module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
                module = _compat_pickle.IMPORT_MAPPING.get(module, module)  # __builtin__
                names.append(f"{module}.{name}")
            elif isinstance(arg, str) and ("UNICODE" in op.name or "STRING" in op.name):
                strings.append(str(arg))
            elif op.name in ("BINPUT", "LONG_BINPUT", "PUT") and strings:
                memo[int(str(arg))] = strings[-1]
            elif op.name == "MEMOIZE" and strings:
                memo[len(memo)] = strings[-1]
            elif op.name in ("BINGET", "LONG_BINGET", "GET") and int(str(arg)) in memo:
                strings.append(memo[int(str(arg))])
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
    except Exception:
        pass  # a malformed pickle: name what was found before it
    found = list(dict.fromkeys(names))
    return found if allowed is None else [n for n in found if not allowed(n)]


def _torch_allows(name: str) -> bool:
    from torch import _weights_only_unpickler as wo

    return name in wo._get_allowed_globals() or name in wo._get_user_allowed_globals()


def pickle_of(file: Path) -> bytes:
    """The pickle of a ``torch.save`` file (its ``data.pkl``), or the file itself."""
    try:
        with zipfile.ZipFile(file) as archive:
            name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
            return archive.read(name) if name is not None else b""
    except (OSError, zipfile.BadZipFile, KeyError, ValueError):
        try:
            return file.read_bytes()
        except OSError:
            return b""


def refusal_reason(exc: BaseException, data: bytes) -> list[str]:
    """What the safe loader refused: the globals a static read finds, else its message."""
    refused = refused_globals(data, _torch_allows)
    if refused:
        return refused
    match = re.search(r"GLOBAL (\S+) was not an allowed global", str(exc))
    if match:
        return [match.group(1)]
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return [first[:200]]


def _host_format(data: bytes) -> int | None:
    """The ``format`` a cudakit rank file's pickle starts with, read without running it
    (the first key of the dict it holds), else None."""
    seen_key = False
    try:
        for count, (op, arg, _) in enumerate(pickletools.genops(data)):
            if count > 8:
                return None
            if isinstance(arg, str) and "UNICODE" in op.name:
                seen_key = arg == "format"
                if not seen_key:
                    return None
            elif seen_key and op.name in ("BININT", "BININT1", "BININT2", "INT", "LONG1"):
                return int(arg) if isinstance(arg, int) else None
    except Exception:
        return None
    return None


def _old_format(file: Path, found: object) -> CheckpointError:
    return CheckpointError(
        f"{_FUNC}: {file} was written by an older cudakit (host format {found}; this one "
        f"reads {layout.HOST_FORMAT}), whose rank files only pickle's full loader reads, "
        "and that loader runs any code a file holds. If you wrote this checkpoint and "
        "nobody else could change it, load it with Checkpointer(..., trust_pickles=True); "
        "its next save is in the new format. Otherwise start in a new directory."
    )


def _refusal(
    file: Path | str, refused: Sequence[str], what: str, user_types: bool = True
) -> RefusedCheckpointError:
    names = ", ".join(refused)
    allow = (
        " If this run saved it with a type of its own, allow the type with "
        "Checkpointer(..., safe_globals=[TheType])."
        if user_types
        else ""
    )
    return RefusedCheckpointError(
        f"{_FUNC}: {file} holds {names}, which the safe loader refuses ({what}); nothing "
        "of it ran. A checkpoint that others could write may have been changed: load only "
        f"checkpoints you wrote, or copied from where only you could write.{allow}",
        file=str(file),
        refused=refused,
    )


# ---------------------------------------------------------------------------- host files


def load_host(file: Path, *, trust: bool, safe_globals: Sequence[Any] = ()) -> Any:
    """A rank file's contents, read with torch's safe loader (``trust``: pickle's full
    loader).

    Raises:
        RefusedCheckpointError: the file names a global the safe loader refuses.
        CheckpointError: a rank file of an older host format (without ``trust``).
        Exception: what ``torch.load`` raises for an unreadable file (a corrupted one).
    """
    if trust:
        return torch.load(file, weights_only=False, map_location="cpu")
    try:
        with allowed_globals(safe_globals), warnings.catch_warnings():
            # (torch warns of a pickle protocol it did not write: a refusal follows)
            warnings.filterwarnings("ignore", message=".*pickle protocol", category=UserWarning)
            host = torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        data = pickle_of(file)
        found = _host_format(data)
        if found is not None and found < layout.HOST_FORMAT:
            raise _old_format(file, found) from None
        with allowed_globals(safe_globals):
            refused = refusal_reason(exc, data)
        raise _refusal(file, refused, "torch.load(weights_only=True)") from None
    found = host.get("format") if isinstance(host, dict) else None
    if is_int(found) and found < layout.HOST_FORMAT:
        raise _old_format(file, found)
    return host


# ---------------------------------------------------------------------------- DCP


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
                    raise _refusal(where, [exc.name], "DCP's metadata allowlist", False) from None
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
                        if not view.seekable():
                            view = io.BytesIO(view.read(-1))
                        loaded = torch.load(view, map_location="cpu", weights_only=True)
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
            self, reader: Any, safe_globals: Sequence[Any], fresh: Collection[int], trust: bool
        ) -> None:
            super().__init__()
            self.reader = reader
            self.user_globals = tuple(safe_globals)
            self.fresh = fresh  # ids of the state dict's tensors to leave untouched
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
                raise _refusal(file, refused, what) from None
            self._put(read_item.dest_index.fqn, obj)

        def _put(self, fqn: str, obj: Any) -> None:
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.original_state_dict[fqn] = obj
            self.state_dict[fqn] = obj

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


def pickle_of_bytes(value: io.BytesIO) -> bytes:
    try:
        with zipfile.ZipFile(io.BytesIO(value.getvalue())) as archive:
            name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
            return archive.read(name) if name is not None else b""
    except Exception:
        return value.getvalue()


_PLANNER: list[type] = []


def safe_planner(
    reader: Any,
    safe_globals: Sequence[Any] = (),
    *,
    fresh: Collection[int] = (),
    trust: bool = False,
) -> Any:
    """DCP's ``DefaultLoadPlanner``, its pickled values read with torch's safe loader
    (``trust``: pickle's full loader), the tensors whose ids are in ``fresh`` loaded into
    new storage: the state dict then holds the new tensors, and those it held before
    are left as they were."""
    if not _PLANNER:
        _PLANNER.append(_planner_class())
    return _PLANNER[0](reader, safe_globals, fresh, trust)


def dcp_load(
    state: dict[str, Any],
    root: Path,
    *,
    distributed: bool,
    trust: bool = False,
    safe_globals: Sequence[Any] = (),
    reader: Any = None,
    fresh: Collection[int] = (),
) -> None:
    """DCP's ``load`` of ``state`` from ``root``, through the safe reader and planner: in
    place, except the tensors whose ids are in ``fresh``, which ``state`` then holds new
    (CPU) tensors for, and which are left untouched.

    Raises:
        RefusedCheckpointError: a file holds a global the allowlists refuse.
        CheckpointError: a data file that cannot be read (naming it where known).
        BaseException: DCP's own failures otherwise (its ``CheckpointException``).
    """
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = reader if reader is not None else dcp_reader(root, trust=trust)
    kwargs: dict[str, Any] = {} if distributed else {"no_dist": True}
    kwargs["planner"] = safe_planner(reader, safe_globals, fresh=fresh, trust=trust)
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
                raise _refusal(
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
