"""The state of one walk over user data: its context and the staging of prefetch copies.

:class:`Ctx` is what one ``on_device`` call carries along (target, copy mode, memo,
deferred in-place moves); :class:`Staging` is what prefetch adds to the same walk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "Ctx",
    "Handler",
    "NoType",
    "Staging",
    "device_kind",
]

Handler = Callable[[Any, "Ctx"], Any]
_Tensor = torch.Tensor
# Copies there are synchronous unless forced. MPS too: a CPU -> MPS non_blocking copy
# from pageable memory can be read before it lands (pytorch/pytorch#83015).
_SYNC_TARGETS = ("cpu", "meta", "mps")


class NoType:
    """A type no value has: turns the inline tensor path of _dict and _seq off."""


class Ctx:
    """State of one ``on_device`` call: target, copy mode, memo, deferred in-place moves.

    Made once per call, so it is kept small: what most calls never need (deferred
    moves, unknown objects, values kept alive, devices to wait for) is made on first use.
    """

    __slots__ = (
        "device",
        "hot",
        "keep",
        "loose",
        "memo",
        "nb",
        "pending",
        "staging",
        "stay",
        "sync",
        "track",
        "unknown",
    )

    def __init__(
        self,
        device: torch.device,
        non_blocking: bool | None,
        staging: Staging | None = None,
        kind: tuple[bool, bool] | None = None,
    ) -> None:
        if kind is None:
            kind = device_kind(device)
        nb = not kind[0] if non_blocking is None else non_blocking
        # A forced non_blocking copy to the CPU must be waited for before we return.
        track = nb and kind[1]
        # id(obj) -> result. Ids stay unique because the input keeps its objects alive;
        # values a custom mapping makes on the fly are kept alive in `keep`.
        memo: dict[int, Any] = {}
        self.device = device
        # prefetch's extras (pinning, the tensors created); None for on_device, whose
        # plain tensors then take the inline fast path of _dict and _seq.
        self.staging = staging
        self.nb = nb
        self.track = track
        self.memo = memo
        self.keep: list[Any] | None = None
        # In-place moves (modules, optimizer state) run only after the whole traversal
        # succeeded, so an error anywhere leaves everything the user owns untouched.
        self.pending: list[Callable[[], None]] | None = None
        # Objects of unknown types met on the way, probed for tensors once the walk is
        # done: tensors the same call moves (a scheduler's optimizer) are not left behind.
        self.unknown: list[Any] | None = None
        self.sync: set[torch.device] = set() if track else _NO_SYNC  # type: ignore[assignment]
        # True once a tensor is in the memo by another way than the inline paths of _dict
        # and _seq (a Parameter's .grad, a module's parameters): those paths then look
        # every tensor up, not only the ones the input holds more than once.
        self.loose = False
        # The inline paths' guess that tensors are already on the device (adaptive).
        self.stay = True
        # What _dict and _seq read once per container, in one attribute load. While
        # staging (prefetch) no type matches the inline tensor path: every tensor goes
        # through _tensor, which pins and lists it.
        self.hot = (memo, device, nb, track, _Tensor if staging is None else NoType)

    def defer(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the whole walk succeeded (:func:`cudakit._tree.finish`)."""
        if self.pending is None:
            self.pending = [action]
        else:
            self.pending.append(action)

    def kept(self) -> list[Any]:
        """The list of values to keep alive until the walk ends (their ids are in the memo)."""
        if self.keep is None:
            self.keep = []
        return self.keep

    def met_unknown(self, x: object) -> None:
        """Remember an object of an unknown type, probed for tensors once the walk is done."""
        if self.unknown is None:
            self.unknown = [x]
        else:
            self.unknown.append(x)


_NO_SYNC: frozenset[torch.device] = frozenset()


def device_kind(device: torch.device) -> tuple[bool, bool]:
    """``(copies there are synchronous by default, device is the CPU)``, cached.

    ``torch.device.type`` builds a new string at every read, so the answer is kept, and
    the device last asked about is recognised by identity (callers pass the cached
    ``torch.device`` objects of :func:`~cudakit.device.resolve.resolve_cached`).
    """
    global _LAST_KIND
    last = _LAST_KIND
    if device is last[0]:
        return last[1]
    kind = _KINDS.get(device)
    if kind is None:
        kind = _KINDS[device] = (device.type in _SYNC_TARGETS, device.type == "cpu")
    _LAST_KIND = (device, kind)
    return kind


class Staging:
    """What prefetch needs from the same walk that moves a batch.

    * ``pin``: copy CPU tensors through page-locked memory (plain dense tensors only);
    * ``created``: every tensor the walk made on the device, to be ``record_stream``-ed;
    * ``opaque``: objects moved by their own ``.to()``, whose new tensors the walk
      could not see (see :func:`device_tensors_in`);
    * ``on_device_tensor``: called once, before the first tensor that is not on the CPU
      is used (its producer must be ordered before the copy stream).
    """

    __slots__ = ("created", "on_device_tensor", "opaque", "pin", "saw_device_tensor")

    def __init__(self, *, pin: bool, on_device_tensor: Callable[[], None] | None = None) -> None:
        self.pin = pin
        self.on_device_tensor = on_device_tensor
        self.saw_device_tensor = False
        self.created: list[torch.Tensor] = []
        self.opaque: list[Any] = []

    def device_tensor_seen(self) -> None:
        if not self.saw_device_tensor:
            self.saw_device_tensor = True
            if self.on_device_tensor is not None:
                self.on_device_tensor()


# device -> (copies there are synchronous by default, device is the CPU)
_KINDS: dict[torch.device, tuple[bool, bool]] = {}
_LAST_KIND: tuple[object, tuple[bool, bool]] = (None, (False, False))
