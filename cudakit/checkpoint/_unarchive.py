"""Reading tensors' archives out of a data file, unpickling one of each layout.

Each tensor of a DCP data file is the archive ``torch.save`` wrote for it. Archives of
tensors of one kind are the same bytes but for the storage, its CRC-32 and the
serialization id (:mod:`~cudakit.checkpoint._archive` writes them so). ``torch.load``
unpickles each one all the same (~0.4 ms a tensor, a third of loading 100M
parameters in memory already faulted in). :class:`TensorReader` loads the first
archive of each size with ``torch.load`` and keeps its layout; an archive of that
size whose bytes around the storage are the same but for those holes is the same
tensor over other bytes, so its storage is read straight into new memory, with
nothing unpickled. Anything else (another layout, a short file, a tensor that is not
a plain host tensor) is ``torch.load``'s, with its errors.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
from typing import IO, Any

import torch

from ._archive import layout_of, plain_host, storage_buffer

__all__ = ["TensorReader"]

_LEARN_LIMIT = 1 << 26  # larger archives are not copied again to learn from (64 MiB)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One archive's bytes around its storage (``tail`` with its holes zeroed), and the
    tensor the storage is viewed as."""

    head: bytes
    tail: bytes
    holes: tuple[tuple[int, int], ...]  # (start, end) in the tail: CRC-32s and the id
    digits: tuple[int, int] | None  # the serialization id's (torch.load decodes them)
    size: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def fits(self, tail: bytes) -> bool:
        """Whether ``tail`` is this layout's but for its holes, the id all digits."""
        if len(tail) != len(self.tail):
            return False
        if self.digits is not None and not tail[self.digits[0] : self.digits[1]].isdigit():
            return False
        return self.masked(tail) == self.tail

    def holds(self, target: torch.Tensor) -> bool:
        """Whether this layout's storage is exactly ``target``'s memory, byte for byte."""
        return (
            self.size > 0
            and self.offset == 0
            and target.dtype == self.dtype
            and tuple(target.shape) == self.shape
            and target.stride() == self.stride
            and target.is_contiguous()
            and target.numel() * target.element_size() == self.size
        )

    def masked(self, tail: bytes) -> bytes:
        if not self.holes:
            return tail
        out = bytearray(tail)
        for start, end in self.holes:
            out[start:end] = bytes(end - start)
        return bytes(out)


class TensorReader:
    """Loads the tensors of one load's data files (their archives' layouts kept by
    size, for the load's length)."""

    def __init__(self) -> None:
        self._layouts: dict[int, _Layout | None] = {}
        #: The storages :meth:`defer` left to :meth:`read_later`: (file, where, bytes,
        #: the tensor whose memory they go into).
        self._later: list[tuple[str, int, int, torch.Tensor]] = []

    def _learn(self, view: IO[bytes], length: int) -> Any:
        """``torch.load`` of the archive at ``view``, its layout kept for its size."""
        raw = view.read(length)
        loaded = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        self._layouts[length] = _learn(raw, loaded)
        return loaded

    def defer(self, view: IO[bytes], length: int, target: torch.Tensor, file: str, at: int) -> bool:
        """Check the archive at ``view`` (``length`` bytes, at ``at`` in ``file``) as
        its size's layout, and leave its storage to be read into ``target``'s memory by
        :meth:`read_later`: True where it fits, else nothing is kept (False)."""
        if not view.seekable():
            return False
        if length not in self._layouts and length <= _LEARN_LIMIT:
            self._learn(view, length)  # (the tensor it reads is dropped)
            view.seek(0)
        layout = self._layouts.get(length)
        if layout is None or not layout.holds(target):
            return False
        if view.read(len(layout.head)) == layout.head:
            view.seek(len(layout.head) + layout.size)
            if layout.fits(view.read(len(layout.tail))):
                self._later.append((file, at + len(layout.head), layout.size, target))
                return True
        view.seek(0)
        return False

    @property
    def waiting(self) -> set[int]:
        """The ids of the tensors :meth:`defer` left to :meth:`read_later`."""
        return {id(target) for *_, target in self._later}

    def read_later(self) -> None:
        """Read every storage :meth:`defer` left into its tensor's memory: all of them,
        even when one fails or this is interrupted; then raise the first problem.

        Raises:
            OSError: a file that cannot be read, or ends early.
        """
        later, self._later = sorted(self._later, key=lambda item: item[:2]), []
        problem: BaseException | None = None
        for file, at, size, target in later:
            try:
                with open(file, "rb", buffering=0) as stream:
                    stream.seek(at)
                    buffer = (ctypes.c_char * size).from_address(target.data_ptr())
                    if not _fill(stream, memoryview(buffer).cast("B")):
                        raise OSError(f"{file} ends before the end of a tensor")
                torch.autograd.graph.increment_version(target)  # as copy_ counts
            except BaseException as exc:  # (the others are read first)
                problem = problem or exc
        if problem is not None:
            raise problem

    def read(self, view: IO[bytes], length: int) -> Any:
        """``torch.load(view, map_location="cpu", weights_only=True)`` of an archive of
        ``length`` bytes, read without unpickling where its size's layout fits."""
        seekable = view.seekable()
        known = length in self._layouts
        layout = self._layouts.get(length)
        if layout is not None and seekable:
            tensor = _read_as(view, layout)
            if tensor is not None:
                return tensor
            view.seek(0)
        if not known and seekable and length <= _LEARN_LIMIT:
            return self._learn(view, length)
        if not seekable:
            view = io.BytesIO(view.read(-1))
        return torch.load(view, map_location="cpu", weights_only=True)


def _learn(raw: bytes, loaded: Any) -> _Layout | None:
    """The layout of archive ``raw``, which ``torch.load`` read as ``loaded`` (None: not
    a plain host tensor over the archive's one storage record)."""
    if not plain_host(loaded):
        return None
    storage = loaded.untyped_storage()
    size = storage.nbytes()
    data = bytes(storage_buffer(storage))
    found = layout_of(raw, data)
    if found is None:
        return None
    head, tail, crcs, digits = found
    layout = _Layout(
        head=head,
        tail=b"",
        holes=crcs if digits is None else (*crcs, digits),
        digits=digits,
        size=size,
        dtype=loaded.dtype,
        shape=tuple(loaded.shape),
        stride=loaded.stride(),
        offset=int(loaded.storage_offset()),
    )
    return dataclasses.replace(layout, tail=layout.masked(tail))


def _read_as(view: IO[bytes], layout: _Layout) -> torch.Tensor | None:
    """The tensor of the archive at ``view``, read as ``layout`` says; None where the
    bytes around the storage are not the layout's, or the file ends early."""
    if view.read(len(layout.head)) != layout.head:
        return None
    storage = torch.UntypedStorage(layout.size)
    if layout.size and not _fill(view, memoryview(storage_buffer(storage)).cast("B")):
        return None
    if not layout.fits(view.read(len(layout.tail))):
        return None
    tensor = torch.empty(0, dtype=layout.dtype)
    return tensor.set_(storage, layout.offset, layout.shape, layout.stride)


def _fill(stream: Any, buffer: memoryview) -> bool:
    """Read ``stream`` into all of ``buffer``; False where it ends first."""
    done = 0
    while done < len(buffer):
        n = stream.readinto(buffer[done:])
        if not n:
            return False
        done += n
    return True
