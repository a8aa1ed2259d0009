"""Where checkpoints live on disk, which of them are complete, and which to remove.

A checkpoint directory holds one sub-directory per checkpoint::

    runs/exp/
        ckpt-0000000400/          complete: manifest written last, then renamed
            .metadata             torch.distributed.checkpoint's index of the shards
            __0_0.distcp ...      the model and optimizer shards (one file per rank)
            rank-00000.pt         host state: RNG, data position, step, extras
            cudakit.json          the manifest: position, world size, file sizes
        ckpt-0000000600.partial/  being written (or left by a crash): never loaded

A checkpoint is written under its ``.partial`` name and becomes visible only when
rank 0, after every rank has finished, writes the manifest and renames the
directory (an atomic rename on one file system). Everything here is a pure function
of the file system: no process group, no torch state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .._check import is_int
from ..exceptions import CheckpointSaveError

__all__ = [
    "MANIFEST",
    "PARTIAL",
    "Found",
    "Manifest",
    "checkpoint_name",
    "fsync_dir",
    "list_checkpoints",
    "probe_writable",
    "publish",
    "read_manifest",
    "remove_checkpoint",
    "remove_set_aside",
    "remove_stale_partials",
    "set_aside",
    "to_remove",
    "write_manifest",
]

#: The manifest's file name; written last, so its presence (and sizes) mean complete.
MANIFEST = "cudakit.json"
#: Suffix of a checkpoint directory that is still being written.
PARTIAL = ".partial"
#: The suffix of a checkpoint being removed (``keep=``): not a checkpoint any more.
REMOVING = ".removing"
#: The suffix of a checkpoint that a newer one of the same name is replacing.
REPLACED = ".replaced"
_LEFT = (PARTIAL, REMOVING, REPLACED)
#: Bumped when the layout changes in a way older code cannot read.
FORMAT = 1
#: The format of the rank files (``rank-NNNNN.pt``), bumped likewise (2: read with
#: torch's safe loader, NumPy's RNG state as a tensor).
HOST_FORMAT = 2

_NAME = re.compile(r"^ckpt-(\d{10})$")


def probe_writable(root: Path, rank: int) -> None:
    """Make ``root`` if needed and write a file there (else :class:`CheckpointSaveError`)."""
    probe = root / f".cudakit-write-test-{rank}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CheckpointSaveError(
            f"Checkpointer(directory={str(root)!r}): the directory cannot be written "
            f"({type(exc).__name__}: {exc.strerror or exc}). Expected a directory this "
            "process can create files in (on a file system every rank shares); choose "
            "another one or fix its permissions."
        ) from None


def checkpoint_name(steps: int) -> str:
    """The directory name of the checkpoint taken after ``steps`` optimizer steps (the
    position's windows; the saves themselves where a loop shows no steps).

    >>> checkpoint_name(20)
    'ckpt-0000000020'
    """
    return f"ckpt-{steps:010d}"


def rank_file(rank: int) -> str:
    """The file holding one rank's host state."""
    return f"rank-{rank:05d}.pt"


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint says about itself (``cudakit.json``)."""

    total: int
    epoch: int
    batch: int
    windows: int
    world_size: int
    models: tuple[str, ...]
    optimizers: int
    schedulers: int
    steps: int
    mid_epoch_data: bool
    files: dict[str, int]
    #: The order checkpoints were written in (1, 2, ...; 0: a manifest from before
    #: this field), so that a run rolled back to an older checkpoint continues from
    #: its own newer ones, not from the abandoned steps of higher number.
    serial: int = 0

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["format"] = FORMAT
        data["models"] = list(self.models)
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("the manifest is not a JSON object")
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this cudakit reads {FORMAT}")
        ints = ("total", "epoch", "batch", "windows", "world_size", "optimizers", "schedulers")
        data.setdefault("serial", 0)
        for key in (*ints, "steps", "serial"):
            value = data.get(key)
            if not (is_int(value) and value >= 0):
                raise ValueError(f"field {key!r} is {value!r}, not an int >= 0")
        files = data.get("files")
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and is_int(v) for k, v in files.items()
        ):
            raise ValueError("field 'files' is not a mapping of file names to sizes")
        models = data.get("models")
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ValueError("field 'models' is not a list of names")
        return cls(
            total=data["total"],
            epoch=data["epoch"],
            batch=data["batch"],
            windows=data["windows"],
            world_size=data["world_size"],
            models=tuple(models),
            optimizers=data["optimizers"],
            schedulers=data["schedulers"],
            steps=data["steps"],
            mid_epoch_data=bool(data.get("mid_epoch_data", False)),
            files=dict(files),
            serial=data["serial"],
        )


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(partial: Path, final: Path, fields: dict[str, Any]) -> Found:
    """Finish a checkpoint: list its files, write the manifest last, rename it visible.

    Runs on rank 0 only, after every rank has written its part. Its serial number is
    one more than the newest complete checkpoint's in the directory. Returns the
    directory's checkpoints with this one in (the one listing a save makes).
    """
    files = {
        str(p.relative_to(partial)): p.stat().st_size
        for p in sorted(partial.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    found = list_checkpoints(final.parent)
    serial = 1 + max((m.serial for _, m in found.complete), default=0)
    manifest = Manifest(files=files, **fields, serial=serial)
    # Written in place: the directory is still .partial, and a manifest cut short is
    # no JSON, so no complete checkpoint (remove_stale_partials removes it).
    with open(partial / MANIFEST, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(partial)
    publish(partial, final)
    others = tuple(item for item in found.complete if item[0] != final)
    return Found((*others, (final, manifest)), found.broken)


def publish(partial: Path, final: Path) -> None:
    """Rename the finished ``partial`` (its manifest written) to ``final``.

    A checkpoint of the same name (the same position saved again, or the abandoned
    branch of a rolled-back run) is renamed aside (``.replaced``) only now that its
    successor is complete, and removed only once the successor is visible. A kill in
    between leaves the successor complete under its ``.partial`` name, which
    :func:`remove_stale_partials` renames into place at the next resume: no instant
    of a save leaves the directory without its newest complete checkpoint.
    """
    aside = final.with_name(final.name + REPLACED)
    replacing = os.path.lexists(final)
    if replacing:
        if os.path.lexists(aside):  # left by a process killed mid-removal
            _remove(aside)
        os.replace(final, aside)
    try:
        os.replace(partial, final)
    except OSError:
        if replacing:  # put the old one back: nothing the user had changes on a failure
            os.replace(aside, final)
        raise
    fsync_dir(final.parent)
    if replacing:
        _remove(aside)


def _remove(path: Path) -> None:
    """Remove a directory (or a link to one: the link only)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def read_manifest(path: Path) -> Manifest:
    """The manifest of checkpoint ``path``, checked against the files it lists.

    Raises:
        ValueError: no manifest, a malformed one, or a file missing or of another size
            (a truncated or partly deleted checkpoint), naming what is wrong.
    """
    file = path / MANIFEST
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(
            f"{path} is not a complete cudakit checkpoint: it has no {MANIFEST} (the "
            "manifest is written last, so the save did not finish)"
        ) from None
    try:
        manifest = Manifest.from_json(text)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{file} is corrupted: {exc}") from None
    for name, size in manifest.files.items():
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            raise ValueError(f"{path} is corrupted: {name} is missing") from None
        if actual != size:
            raise ValueError(
                f"{path} is corrupted: {name} has {actual} bytes, the manifest says {size} "
                "(a truncated or overwritten file)"
            )
    return manifest


@dataclasses.dataclass(frozen=True)
class Found:
    """The checkpoints of a directory: complete ones (oldest written first) and the rest."""

    complete: tuple[tuple[Path, Manifest], ...]
    broken: tuple[tuple[Path, str], ...]

    @property
    def latest(self) -> tuple[Path, Manifest] | None:
        return self.complete[-1] if self.complete else None


def list_checkpoints(root: Path) -> Found:
    """Every ``ckpt-N`` directory of ``root``: the complete ones and why the others are not.

    Complete ones are in the order they were written (their manifests' serial numbers,
    then their step numbers): the last is the newest, also after a rollback.
    """
    complete: list[tuple[tuple[int, int], Path, Manifest]] = []
    broken: list[tuple[Path, str]] = []
    if not root.is_dir():
        return Found((), ())
    for entry in sorted(root.iterdir()):
        match = _NAME.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        try:
            manifest = read_manifest(entry)
        except ValueError as exc:
            broken.append((entry, str(exc)))
            continue
        complete.append(((manifest.serial, int(match.group(1))), entry, manifest))
    complete.sort(key=lambda item: item[0])
    return Found(tuple((p, m) for _, p, m in complete), tuple(broken))


def remove_stale_partials(root: Path) -> list[Path]:
    """Finish what a killed save left: returns the half-written saves removed.

    A ``.partial`` directory whose manifest is written and whose files are all there
    is a complete checkpoint a kill caught before (or while) :func:`publish` renamed
    it: it is renamed into place when no checkpoint holds its name, else (the older
    one of that name is still whole) removed. Any other ``.partial`` (a save that never
    finished) goes, as do the ``.removing`` and ``.replaced`` directories a removal
    left (never a checkpoint: they were renamed out of the names first).
    """
    gone: list[Path] = []
    if not root.is_dir():
        return gone
    for entry in sorted(root.iterdir()):
        suffix = next((s for s in _LEFT if entry.name.endswith(s)), None)
        if suffix is None or not _NAME.match(entry.name[: -len(suffix)]):
            continue
        final = entry.with_name(entry.name[: -len(suffix)])
        if suffix == PARTIAL and not os.path.lexists(final) and _complete(entry):
            os.replace(entry, final)  # finished, then killed before its rename
            fsync_dir(root)
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if suffix == PARTIAL:
            gone.append(entry)
    return gone


def _complete(path: Path) -> bool:
    """Whether ``path`` holds a manifest that its files agree with."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        read_manifest(path)
    except ValueError:
        return False
    return True


def remove_checkpoint(path: Path) -> str | None:
    """Remove a complete checkpoint whole or not at all; why it failed, else None.

    It is renamed out of the checkpoints' names first (``.removing``, atomic:
    :func:`set_aside`), so a removal that fails part-way never leaves a checkpoint with
    files missing; what is left goes at the next resume (:func:`remove_stale_partials`).
    """
    doomed = set_aside(path)
    if isinstance(doomed, str):
        return doomed
    return remove_set_aside(doomed)


def set_aside(path: Path) -> Path | str:
    """Rename a checkpoint out of the checkpoints' names (``.removing``): no listing
    sees it from then on. Returns its new path, else why it could not."""
    doomed = path.with_name(path.name + REMOVING)
    try:
        os.replace(path, doomed)
    except OSError as exc:
        return f"{exc} (it is still complete)"
    return doomed


def remove_set_aside(doomed: Path) -> str | None:
    """Remove what :func:`set_aside` renamed; why it failed, else None."""
    try:
        shutil.rmtree(doomed)
    except OSError as exc:
        return f"{exc} (what is left, {doomed.name}, goes at the next resume)"
    return None


def to_remove(complete: Sequence[Path], keep: int | None, protected: Iterable[Path]) -> list[Path]:
    """Which complete checkpoints ``keep=k`` removes: all but the newest ``k``.

    ``complete`` is ordered oldest written first. The newest is never removed, nor is
    any ``protected`` one (the checkpoint this run resumed from, until a newer one is
    complete: the caller stops protecting it then).

    >>> to_remove([Path("a"), Path("b"), Path("c")], 2, [])
    [PosixPath('a')]
    >>> to_remove([Path("a"), Path("b"), Path("c")], 1, [Path("a")])
    [PosixPath('b')]
    """
    if keep is None or len(complete) <= keep:
        return []
    keep_set = set(complete[-max(keep, 1) :]) | set(protected)
    return [p for p in complete if p not in keep_set]
