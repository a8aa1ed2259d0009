"""Payloads an attacker with write access to a run's directory would plant, and where.

Each payload, unpickled by pickle's full loader, writes a sentinel file (``proof``);
each placement puts one into a copy of a genuine checkpoint, as a whole file or
nested inside the genuine structure, and fixes the sizes in ``cudakit.json`` to match.
"""

from __future__ import annotations

import builtins
import functools
import io
import json
import os
import pickle
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cudakit.checkpoint import _layout as layout

PROTOCOLS = tuple(range(pickle.HIGHEST_PROTOCOL + 1))  # 0-5


class Exec:
    def __init__(self, proof: Path) -> None:
        self.proof = proof

    def __reduce__(self) -> Any:
        return exec, (f"import pathlib; pathlib.Path({str(self.proof)!r}).touch()",)


class Eval(Exec):
    def __reduce__(self) -> Any:
        return eval, (f"__import__('pathlib').Path({str(self.proof)!r}).touch()",)


class System(Exec):
    def __reduce__(self) -> Any:
        return os.system, (f"touch {shlex.quote(str(self.proof))}",)


class Popen(Exec):
    def __reduce__(self) -> Any:
        return subprocess.Popen, (["touch", str(self.proof)],)


class _ImportOs:
    def __reduce__(self) -> Any:
        return builtins.__import__, ("os",)


class _Getattr:
    """``getattr(__import__("os"), "system")``, itself called by the outer payload."""

    def __call__(self) -> None:  # (pickle requires a callable there)
        pass

    def __reduce__(self) -> Any:
        return getattr, (_ImportOs(), "system")


class GetattrChain(Exec):
    def __reduce__(self) -> Any:
        return _Getattr(), (f"touch {shlex.quote(str(self.proof))}",)


class NestedLoad(Exec):
    """``torch.load(inner, weights_only=False)`` of a file that holds an ``exec`` payload."""

    def __reduce__(self) -> Any:
        inner = self.proof.with_name(self.proof.name + ".inner.pt")
        if not inner.exists():
            torch.save({"x": Exec(self.proof)}, inner)
        return functools.partial(torch.load, weights_only=False), (str(inner),)


KINDS: dict[str, type[Exec]] = {
    "exec": Exec,
    "eval": Eval,
    "os.system": System,
    "subprocess.Popen": Popen,
    "__import__+getattr": GetattrChain,
    "nested torch.load": NestedLoad,
}


def fix_manifest(ckpt: Path) -> None:
    """Make ``cudakit.json`` list the files' sizes as they are now."""
    manifest = ckpt / layout.MANIFEST
    data = json.loads(manifest.read_text())
    data["files"] = {name: (ckpt / name).stat().st_size for name in data["files"]}
    manifest.write_text(json.dumps(data))


def _metadata(ckpt: Path) -> Any:
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)  # the genuine file, written by this test's own run


def _write_metadata(ckpt: Path, metadata: Any, protocol: int = 4) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata, protocol=protocol))


def rank_raw(ckpt: Path, payload: Any, protocol: int) -> str:
    (ckpt / "rank-00000.pt").write_bytes(pickle.dumps({"format": 2, "x": payload}, protocol))
    return "rank-00000.pt"


def rank_torch_save(ckpt: Path, payload: Any, protocol: int) -> str:
    host = {"format": layout.HOST_FORMAT, "evil": payload}
    torch.save(host, ckpt / "rank-00000.pt", pickle_protocol=max(protocol, 2))
    return "rank-00000.pt"


def rank_nested(ckpt: Path, payload: Any, protocol: int) -> str:
    file = ckpt / "rank-00000.pt"
    host = torch.load(file, weights_only=True)
    if protocol % 2:
        host["extras"]["best"] = ("value", [1.0, {"deep": payload}])
    else:
        host["rng"]["python"] = payload
    torch.save(host, file, pickle_protocol=max(protocol, 2))
    return "rank-00000.pt"


def metadata_whole(ckpt: Path, payload: Any, protocol: int) -> str:
    (ckpt / ".metadata").write_bytes(pickle.dumps(payload, protocol=protocol))
    return ".metadata"


def metadata_field(ckpt: Path, payload: Any, protocol: int) -> str:
    metadata = _metadata(ckpt)
    if protocol % 3 == 0:
        metadata.planner_data = {"model.x": payload}
    elif protocol % 3 == 1:
        metadata.storage_meta.modules = [payload]
    else:
        key = next(iter(metadata.state_dict_metadata))
        metadata.state_dict_metadata[key].chunks = [payload]
    _write_metadata(ckpt, metadata, protocol)
    return ".metadata"


def _redirect(ckpt: Path, key: Callable[[str, Any], bool], blob: bytes) -> str:
    """Point one item of DCP's data at ``blob``, appended to its data file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    metadata = _metadata(ckpt)
    index = next(i for i in metadata.storage_data if key(i.fqn, metadata))
    info = metadata.storage_data[index]
    data = ckpt / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(blob)
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(blob))
    _write_metadata(ckpt, metadata)
    return str(info.relative_path)


def _saved(payload: Any, protocol: int) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer, pickle_protocol=max(protocol, 2))
    return buffer.getvalue()


def distcp_value(ckpt: Path, payload: Any, protocol: int) -> str:
    """An optimizer hyper-parameter, which DCP keeps pickled."""

    def is_value(fqn: str, metadata: Any) -> bool:
        return fqn.endswith(".lr") and not hasattr(metadata.state_dict_metadata[fqn], "size")

    return _redirect(ckpt, is_value, _saved(payload, protocol))


def distcp_tensor(ckpt: Path, payload: Any, protocol: int) -> str:
    """A weight's record, which DCP reads with torch.load(weights_only=True)."""

    def is_weight(fqn: str, metadata: Any) -> bool:
        return fqn.endswith("weight") and fqn.startswith("model.")

    return _redirect(ckpt, is_weight, _saved(payload, protocol))


PLACES: dict[str, Callable[[Path, Any, int], str]] = {
    "rank file, raw pickle": rank_raw,
    "rank file, torch.save": rank_torch_save,
    "rank file, nested": rank_nested,
    ".metadata, whole": metadata_whole,
    ".metadata, in a field": metadata_field,
    "data file, a pickled value": distcp_value,
    "data file, a tensor record": distcp_tensor,
}


def plant(ckpt: Path, place: str, kind: str, protocol: int, proof: Path) -> str:
    """Plant payload ``kind`` at ``place`` of checkpoint ``ckpt``; returns the file's name."""
    name = PLACES[place](ckpt, KINDS[kind](proof), protocol)
    fix_manifest(ckpt)
    return name
