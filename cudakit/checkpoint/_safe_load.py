"""Reading a checkpoint's host pickles without running anything they hold.

A pickle can name any function of any module and call it while it loads (``os.system``,
``exec``): loading a file someone else could write hands them the process. So every
file of a checkpoint is read through an allowlist, and what it does not admit is a
:class:`RefusedCheckpointError` naming the file and the refused global, raised before
that global is looked up. Here: each rank's host file (``rank-NNNNN.pt``), read with
torch's safe loader, ``torch.load(weights_only=True)``: tensors and plain containers,
NumPy arrays of numbers, and the types the user allowed
(``Checkpointer(safe_globals=[...])``); the allowlist itself (:func:`allowed_globals`),
and the static read that names what a pickle refers to (:func:`refused_globals`,
:func:`refusal_reason`). DCP's files are read by :mod:`~cudakit.checkpoint._safe_dcp`,
through the same allowlist and messages.

What cudakit saves is checked first (:mod:`~cudakit.checkpoint._admit`), so a value the
safe loader would refuse is refused at ``save()``, not found at resume.
``trust=True`` reads with pickle's full loader instead: checkpoints written before
host format 2 need it.
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .._check import is_int
from ..exceptions import CheckpointError
from . import _layout as layout

__all__ = [
    "RefusedCheckpointError",
    "Unloadable",
    "allowed_globals",
    "load_host",
    "pickle_of",
    "pickle_of_bytes",
    "refusal_error",
    "refusal_reason",
    "refused_globals",
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


def pickle_of_bytes(value: io.BytesIO) -> bytes:
    try:
        with zipfile.ZipFile(io.BytesIO(value.getvalue())) as archive:
            name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
            return archive.read(name) if name is not None else b""
    except Exception:
        return value.getvalue()


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


def refusal_error(
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
        raise refusal_error(file, refused, "torch.load(weights_only=True)") from None
    found = host.get("format") if isinstance(host, dict) else None
    if is_int(found) and found < layout.HOST_FORMAT:
        raise _old_format(file, found)
    return host
