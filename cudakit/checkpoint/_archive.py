"""``torch.save`` archives of host tensors, made from a template of their kind.

DCP writes each tensor of a data file as an archive of its own: the zip file
``torch.save(tensor, f)`` writes (the pickle, a few small records, the tensor's
storage, a serialization id). For tensors of one kind (dtype, shape, strides, storage
size) these archives are the same bytes but for the storage, its CRC-32 and the
serialization id, which torch derives from the records' CRC-32s. So the first archive
of each kind is ``torch.save``'s own and becomes a template; the next ones are the
template with those three parts put in: the same bytes, without pickling again
(~80 µs a tensor for ``torch.save``, a few µs here, which on a small model is most
of a save).

A template is used only once it reproduces ``torch.save``'s archives of two tensors
of its kind with other bytes, byte for byte; a torch that writes them otherwise
(another record that depends on the data) keeps ``torch.save`` for that kind. Tensors
that are not plain host tensors (a subclass, ``requires_grad``, conjugate or negative
bits, attributes of their own) always go through ``torch.save``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import struct
import zipfile
import zlib
from typing import IO, Any

import torch

__all__ = ["Archives", "forget", "layout_of", "plain_host", "save", "storage_buffer"]

_MASK = (1 << 64) - 1
_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL = b"PK\x01\x02"
_LIMIT = 4096  # kinds kept; more and the templates start over


def _hash_combine(seed: int, value: int) -> int:
    """c10's ``hash_combine`` on 64-bit ``size_t``, which folds the records' CRC-32s
    into the serialization id."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK) + (seed >> 2)) & _MASK)) & _MASK


@dataclasses.dataclass(frozen=True)
class _Template:
    """One kind's archive: ``head`` (up to the storage's bytes, the same for every
    tensor of the kind), then the storage, then ``tail`` with holes for the storage's
    CRC-32, the serialization id and its CRC-32."""

    head: bytes
    tail: bytes
    size: int  # the storage's bytes
    data_crc_at: tuple[int, ...]
    # the serialization id (None: this torch writes none): where it is, the digits that
    # do not change, the fold of the CRC-32s before the storage's and after it
    sid_at: int | None = None
    sid_prefix: bytes = b""
    sid_crc_at: tuple[int, ...] = ()
    folded_before: int = 0
    crcs_after: tuple[int, ...] = ()

    def tail_for(self, crc: int) -> bytes:
        tail = bytearray(self.tail)
        packed = struct.pack("<I", crc)
        for at in self.data_crc_at:
            tail[at : at + 4] = packed
        if self.sid_at is not None:
            folded = _hash_combine(self.folded_before, crc)
            for after in self.crcs_after:
                folded = _hash_combine(folded, after)
            sid = self.sid_prefix + b"%020d" % folded
            tail[self.sid_at : self.sid_at + len(sid)] = sid
            packed = struct.pack("<I", zlib.crc32(sid))
            for at in self.sid_crc_at:
                tail[at : at + 4] = packed
        return bytes(tail)

    def pieces(self, data: Any) -> tuple[bytes, Any, bytes]:
        """The archive of a tensor whose storage is ``data``, in three pieces."""
        return self.head, data, self.tail_for(zlib.crc32(data))

    def write(self, data: Any, file: IO[bytes]) -> None:
        for piece in self.pieces(data):
            file.write(piece)


#: Each kind's template, or None where this torch's archives are not reproduced.
_TEMPLATES: dict[tuple[Any, ...], _Template | None] = {}


def forget() -> None:
    """Drop every template (the next archive of each kind is ``torch.save``'s again)."""
    _TEMPLATES.clear()


class Archives:
    """Writes tensors' archives with the serialization settings of the moment (read once:
    make one for each file)."""

    def __init__(self) -> None:
        self._settings: tuple[Any, ...] | None
        try:
            from torch.utils.serialization import config

            tls = getattr(torch.serialization, "_serialization_tls", None)
            self._settings = (
                config.save.compute_crc32,
                config.save.storage_alignment,
                getattr(tls, "skip_data", False),
            )
        except (ImportError, AttributeError):  # pragma: no cover - a torch that moved them
            self._settings = None  # (then torch.save writes every archive)

    def save(self, tensor: torch.Tensor, file: IO[bytes]) -> None:
        """Write ``torch.save(tensor, file)``'s bytes into ``file``."""
        for piece in self.pieces(tensor):
            file.write(piece)

    def pieces(self, tensor: torch.Tensor) -> tuple[Any, ...]:
        """``torch.save(tensor)``'s bytes, in pieces to write one after the other (a piece
        may be a view of the tensor's memory: keep the tensor until they are written)."""
        kind = None if self._settings is None else _kind(tensor, self._settings)
        if kind is None:
            return (_torch_saved(tensor),)
        try:
            template = _TEMPLATES[kind]
        except KeyError:
            return (_learn(tensor, kind),)
        if template is None:
            return (_torch_saved(tensor),)
        return template.pieces(_storage_bytes(tensor))


def save(tensor: torch.Tensor, file: IO[bytes]) -> None:
    """Write ``torch.save(tensor, file)``'s bytes into ``file`` (a template's copy when
    the tensor's kind has one)."""
    Archives().save(tensor, file)


def plain_host(tensor: object) -> bool:
    """Whether ``tensor`` is a plain host tensor: its archive is its kind's and its bytes
    (no subclass, ``requires_grad``, conjugate or negative bits, names or attributes)."""
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not any(getattr(tensor, "names", ()))
        and not tensor.__dict__
    )


def _kind(tensor: torch.Tensor, settings: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """What makes one tensor's archive differ from another's but its bytes (None: not a
    plain host tensor, left to ``torch.save``)."""
    if not plain_host(tensor):
        return None
    return (
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        tensor.untyped_storage().nbytes(),
        settings,
    )


def _storage_bytes(tensor: torch.Tensor) -> Any:
    """The tensor's storage as a buffer (no copy; valid while the tensor lives)."""
    return storage_buffer(tensor.untyped_storage())


def storage_buffer(storage: torch.UntypedStorage) -> Any:
    """A host storage's bytes as a writable buffer (no copy; valid while it lives)."""
    size = storage.nbytes()
    if size == 0:
        return b""
    return (ctypes.c_char * size).from_address(storage.data_ptr())


def _torch_saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _learn(tensor: torch.Tensor, kind: tuple[Any, ...]) -> bytes:
    """``torch.save``'s archive of ``tensor``, its kind's template kept when it
    reproduces that archive and one of a tensor of the kind with other bytes."""
    first = _torch_saved(tensor)
    template = _template(first, bytes(_storage_bytes(tensor)))
    if template is not None:
        variant = _variant(tensor)
        for sample, expected in ((tensor, first), (variant, _torch_saved(variant))):
            made = io.BytesIO()
            template.write(_storage_bytes(sample), made)
            if made.getvalue() != expected:
                template = None
                break
    if len(_TEMPLATES) >= _LIMIT:
        _TEMPLATES.clear()
    _TEMPLATES[kind] = template
    return first


def _variant(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of the same kind as ``tensor`` whose storage holds other bytes."""
    storage = tensor.untyped_storage().clone()
    torch.empty(0, dtype=torch.uint8).set_(storage).bitwise_not_()
    return torch.empty(0, dtype=tensor.dtype).set_(
        storage, tensor.storage_offset(), tensor.shape, tensor.stride()
    )


def _template(archive: bytes, data: bytes) -> _Template | None:
    """The template of ``archive`` (holding the storage ``data``), or None where its
    layout is not the one expected: one ``data/`` record holding exactly the storage,
    stored, every CRC-32 to change after it."""
    try:
        with zipfile.ZipFile(io.BytesIO(archive)) as zf:
            infos = zf.infolist()
            central = zf.start_dir
    except (zipfile.BadZipFile, AttributeError, ValueError):
        return None
    records = [i for i in infos if i.filename.split("/", 1)[-1].startswith("data/")]
    sids = [i for i in infos if i.filename.endswith("/.data/serialization_id")]
    if len(records) != 1 or len(sids) > 1 or any(i.compress_type for i in infos):
        return None
    record = records[0]
    start, end = _data_range(archive, record)
    if archive[start:end] != data:
        return None
    crc_at: dict[str, list[int]] = {i.filename: [] for i in infos}
    at = central
    for info in infos:  # the central directory: one entry per record, in order
        if archive[at : at + 4] != _CENTRAL:
            return None
        crc_at[info.filename].append(at + 16)
        names, extra, comment = struct.unpack_from("<HHH", archive, at + 28)
        at += 46 + names + extra + comment
    for info in infos:
        if info.flag_bits & 0x08:  # a data descriptor after the data holds the CRC-32
            end_of = _data_range(archive, info)[1]
            signed = archive.startswith(_DESCRIPTOR, end_of)
            crc_at[info.filename].append(end_of + 4 if signed else end_of)
        else:
            crc_at[info.filename].append(info.header_offset + 14)
    changing = [record, *sids]
    if any(p < end for i in changing for p in crc_at[i.filename]):
        return None
    tail = archive[end:]
    fields: dict[str, Any] = {
        "head": archive[:start],
        "tail": tail,
        "size": end - start,
        "data_crc_at": tuple(p - end for p in crc_at[record.filename]),
    }
    if sids:
        sid = sids[0]
        sid_start, sid_end = _data_range(archive, sid)
        text = archive[sid_start:sid_end]
        order = [i.filename for i in infos]
        before = order[: order.index(record.filename)]
        between = order[order.index(record.filename) + 1 : order.index(sid.filename)]
        crc = {i.filename: i.CRC for i in infos}
        folded = 0
        for name in before:
            folded = _hash_combine(folded, crc[name])
        if sid_start < end or len(text) < 20:
            return None
        fields.update(
            sid_at=sid_start - end,
            sid_prefix=text[:-20],
            sid_crc_at=tuple(p - end for p in crc_at[sid.filename]),
            folded_before=folded,
            crcs_after=tuple(crc[name] for name in between),
        )
    return _Template(**fields)


def layout_of(
    archive: bytes, data: bytes
) -> tuple[bytes, bytes, tuple[tuple[int, int], ...], tuple[int, int] | None] | None:
    """``archive``'s bytes before its storage ``data`` and after it, where in the latter
    the CRC-32s that change with the storage are, and where the serialization id's
    digits are (None: this torch writes none); None where the layout is not the one
    expected."""
    template = _template(archive, data)
    if template is None:
        return None
    crcs = tuple((at, at + 4) for at in (*template.data_crc_at, *template.sid_crc_at))
    digits = None
    if template.sid_at is not None:
        start = template.sid_at + len(template.sid_prefix)
        digits = (start, start + 20)
    return template.head, template.tail, crcs, digits


def _data_range(archive: bytes, info: zipfile.ZipInfo) -> tuple[int, int]:
    """Where a record's bytes are in the archive."""
    names, extra = struct.unpack_from("<HH", archive, info.header_offset + 26)
    start = info.header_offset + 30 + names + extra
    return start, start + info.compress_size
