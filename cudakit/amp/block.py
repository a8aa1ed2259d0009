"""The explicit form's block: ``with step:`` before ``step.backward(loss)``.

Entering the block marks the step as running (:data:`ACTIVE`), pauses gradient sync on
a micro-step that will not step (DDP's ``no_sync``, FSDP2's flag), enters autocast and
snapshots the buffers when a window opens. Leaving it undoes each, innermost first,
even if another raised. :data:`ACTIVE` is also what the step reads to refuse calls
made at the wrong moment (a step inside a step, ``flush()`` inside one).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import Self

from . import misuse

if TYPE_CHECKING:
    from .buffers import BufferSnapshot
    from .window import GradSync, Window

__all__ = ["ACTIVE", "Block", "BlockState"]

#: (step, form) of the autocast_step call running in this thread/task, if any; form is
#: ``"decorated"`` (inside the step function) or ``"block"`` (inside ``with step:``).
ACTIVE: ContextVar[tuple[Any, str] | None] = ContextVar(
    "cudakit_autocast_step_active", default=None
)

#: What ``with step:`` entered: (ACTIVE's token, autocast, paused sync or None).
BlockState = tuple[
    Token[tuple[Any, str] | None], torch.autocast, AbstractContextManager[Any] | None
]


class Block:
    """:class:`~cudakit.amp.AutocastStep`'s ``with step:``; ``step.backward(loss)`` follows."""

    _sync: GradSync
    _window: Window
    _buffers: BufferSnapshot | None
    _as_block: tuple[Any, str]
    _block: BlockState | None
    _awaiting_backward: bool
    device_type: str
    dtype: torch.dtype
    enabled: bool

    def __enter__(self) -> Self:
        """Enter autocast (and pause gradient sync when this micro-step will not step)."""
        active = ACTIVE.get()
        if active is not None:
            raise misuse.nested_error(active[0] is self)
        token = ACTIVE.set(self._as_block)
        paused: AbstractContextManager[Any] | None = None
        autocast: torch.autocast | None = None
        try:
            if self._sync.active and not self._window.closes_next():
                paused = self._sync.paused()
                paused.__enter__()
            autocast = torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)
            autocast.__enter__()
            if self._buffers is not None and not self._buffers.saved:
                self._buffers.save()
        except BaseException:
            _unwind(token, autocast, paused, None, None, None)
            raise
        self._block = (token, autocast, paused)
        self._awaiting_backward = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        block, self._block = self._block, None
        if exc_type is not None:
            self._awaiting_backward = False  # the micro-step was abandoned
        if block is not None:
            _unwind(*block, exc_type, exc, tb)


def _unwind(
    token: Token[tuple[Any, str] | None],
    autocast: torch.autocast | None,
    paused: AbstractContextManager[Any] | None,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> None:
    """Leave what ``__enter__`` entered, innermost first, each even if another raised."""
    try:
        if autocast is not None:
            autocast.__exit__(exc_type, exc, tb)
    finally:
        try:
            if paused is not None:
                paused.__exit__(exc_type, exc, tb)
        finally:
            ACTIVE.reset(token)
