"""Live tensor bytes: a dispatch mode that counts every storage an op creates.

Works alike on fake tensors (the estimate) and real ones: each new storage is
counted once, by its ``nbytes``, until it is freed (a weak reference's callback).
Every allocation and free is logged as an event with the phase it happened in, and
each storage gets an id of its own (a freed storage's address may come back), so
what lived at any moment can be told apart afterwards: parameters, gradients,
optimizer state, the rest.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Event", "LiveBytes"]

#: One allocation (``size > 0``) or free (``size < 0``) of storage ``ident`` in ``phase``.
Event = tuple[int, int, str]


class LiveBytes(TorchDispatchMode):
    """Count the bytes of storages created while the mode is on; log every change.

    Set :attr:`phase` to name what runs (``"forward"``, ``"step"``): each event
    carries it.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.phase = ""
        self.now = 0
        self.peak = 0
        self.events: list[Event] = []
        self._ids: dict[int, tuple[int, int]] = {}  # storage address -> (ident, size)
        self._refs: dict[int, Any] = {}
        self._next = 0

    def known(self, t: torch.Tensor) -> None:
        """Mark ``t``'s storage as living already (a parameter): its views count nothing."""
        self._ids.setdefault(int(t.untyped_storage()._cdata), (-1, 0))

    def ident(self, t: torch.Tensor) -> int | None:
        """The id of the live storage under ``t`` (None: not created under this mode)."""
        found = self._ids.get(int(t.untyped_storage()._cdata))
        return None if found is None or found[0] < 0 else found[0]

    def _free(self, address: int) -> None:
        found = self._ids.pop(address, None)
        self._refs.pop(address, None)
        if found is not None:
            self.now -= found[1]
            self.events.append((found[0], -found[1], self.phase))

    def _forget(self, address: int, _ref: object) -> None:
        self._free(address)

    def add(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage if it is new."""
        storage = t.untyped_storage()
        address = int(storage._cdata)
        if address in self._ids:
            return
        size = int(storage.nbytes())
        ident = self._next
        self._next += 1
        self._ids[address] = (ident, size)
        self._refs[address] = weakref.ref(storage, functools.partial(self._forget, address))
        self.now += size
        self.peak = max(self.peak, self.now)
        self.events.append((ident, size, self.phase))

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.add(t)
        return out
