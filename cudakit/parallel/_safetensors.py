"""The safetensors format, read a slice at a time and written a tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header (each
tensor's dtype, shape and byte range) and the tensors' bytes, row-major. That is
all it takes to read only the rows of one rank's shard (one ``seek`` and one
``readinto`` per tensor, and the bytes read counted) and to write a model one
tensor at a time, so the package is not needed at run time: files written here
load with ``safetensors.torch.load_file``, and the package's files read here.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any, NamedTuple, cast

import torch

__all__ = ["DTYPES", "Entry", "HeaderError", "SliceReader", "read_header", "write_file"]

#: safetensors' dtype names.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the package's own limit


class HeaderError(ValueError):
    """A file whose header is not a valid safetensors header."""


class Entry(NamedTuple):
    """One tensor of a file: where its bytes are."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int


def _bad(file: Path, why: str) -> HeaderError:
    return HeaderError(f"{file} is not a valid safetensors file: {why}")


def read_header(file: Path) -> dict[str, Entry]:
    """The tensors of ``file`` by name, its header checked against its size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad(file, f"{size} bytes, shorter than the 8-byte header length")
        length = int.from_bytes(head, "little")
        if length > min(_MAX_HEADER, size - 8):
            raise _bad(file, f"a header of {length} bytes in a file of {size}")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(file, f"the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _bad(file, f"the header is a JSON {type(header).__name__}, not an object")
    base = 8 + length
    out: dict[str, Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _bad(file, f"the entry of {name!r} is {info!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or begin < 0 or end - begin != nbytes or base + end > size:
            raise _bad(
                file,
                f"{name!r} of shape {list(shape)} ({info['dtype']}) claims bytes "
                f"{begin} to {end} of {size - base}",
            )
        out[name] = Entry(file, dtype, shape, base + begin, base + end)
    return out


class SliceReader:
    """Reads regions of tensors from safetensors files; counts the bytes it read."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self._open: dict[Path, io.BufferedReader] = {}

    def close(self) -> None:
        """Close every file opened."""
        for f in self._open.values():
            f.close()
        self._open.clear()

    def read(self, entry: Entry, region: tuple[slice, ...] | None) -> torch.Tensor:
        """The ``region`` of the tensor (all of it for None), as stored in the file."""
        shape = entry.shape
        rows = slice(0, shape[0] if shape else 1)
        if region is not None and shape:
            rows = region[0]
        row_bytes = math.prod(shape[1:]) * entry.dtype.itemsize
        n = max(rows.stop - rows.start, 0)
        out_shape = (n, *shape[1:]) if shape else ()
        if n * row_bytes == 0:
            data = torch.empty(out_shape, dtype=entry.dtype)
        else:
            f = self._open.get(entry.file)
            if f is None:
                f = self._open[entry.file] = open(entry.file, "rb")  # noqa: SIM115
            buf = bytearray(n * row_bytes)
            f.seek(entry.start + rows.start * row_bytes)
            got = f.readinto(buf)
            self.bytes_read += got
            if got != len(buf):
                raise _bad(entry.file, f"it ended {len(buf) - got} bytes early")
            data = torch.frombuffer(buf, dtype=entry.dtype).reshape(out_shape)
        if region is not None and len(region) > 1:
            data = data[(slice(None), *region[1:])]
        return data


def _header(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        if dtype not in _NAMES:
            raise ValueError(f"safetensors cannot hold {name!r} of dtype {dtype}")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the tensors start 8-byte aligned, as the package's do
    return len(raw).to_bytes(8, "little") + raw


class FileWriter:
    """Writes one safetensors file a tensor at a time, in the order of ``layout``."""

    def __init__(self, file: Path, layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]):
        self.file = file
        self.part = file.with_name(file.name + ".partial")
        self._f: IO[bytes] = open(self.part, "wb")  # noqa: SIM115
        self._f.write(_header((n, d, s) for n, (d, s) in layout.items()))

    def write(self, tensor: torch.Tensor) -> None:
        """The next tensor's bytes."""
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            self._f.write(memoryview(cast(Any, flat.view(torch.uint8).numpy())))

    def close(self) -> None:
        """Flush, and give the file its name."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.part, self.file)

    def abort(self) -> None:
        """Close and remove the partial file."""
        self._f.close()
        self.part.unlink(missing_ok=True)


def write_file(file: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` to one safetensors file (for tests and small models)."""
    writer = FileWriter(file, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()})
    try:
        for value in tensors.values():
            writer.write(value)
    except BaseException:
        writer.abort()
        raise
    writer.close()
