"""The explicit form's block: ``with step:`` before ``step.backward(loss)``.

Entering the block marks the step as running (:data:`ACTIVE`), pauses gradient sync on
a micro-step that will not step (DDP's ``no_sync``, FSDP2's flag), enters autocast and
snapshots the buffers when a window opens. Leaving it undoes each, innermost first,
even if another raised. :class:`Block` keeps where the micro-step is as one
:class:`Turn`. :data:`ACTIVE` is also what the step reads to refuse calls made at the
wrong moment (a step inside a step, ``flush()`` inside one).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from ..parallel._unused import note_unused_parameters
from . import _misuse as misuse

if TYPE_CHECKING:
    from ._buffers import BufferSnapshot
    from ._window import GradSync, Window

__all__ = ["ACTIVE", "Block", "Turn"]

#: (step, form) of the autocast_step call running in this thread/task, if any; form is
#: ``"decorated"`` (inside the step function) or ``"block"`` (inside ``with step:``).
ACTIVE: ContextVar[tuple[Any, str] | None] = ContextVar(
    "cudakit_autocast_step_active", default=None
)


class Turn(enum.Enum):
    """Where the explicit form's micro-step is.

    ``IDLE`` -> ``IN_BLOCK`` at ``with step:``; there ``step.backward(loss)`` makes it
    ``BACKWARD_IN_BLOCK``, and leaving the block makes it ``BACKWARD_DUE`` (backward not
    called yet) or ``IDLE``. ``step.backward(loss)`` after the block, or an exception
    out of the block, ends it (``IDLE``).
    """

    IDLE = "idle"
    IN_BLOCK = "in_block"
    BACKWARD_IN_BLOCK = "backward_in_block"
    BACKWARD_DUE = "backward_due"


class Block:
    """``with step:`` of one :class:`~cudakit.amp.AutocastStep`: what it entered, and its turn."""

    __slots__ = (
        "_autocast",
        "_buffers",
        "_entered",
        "_marker",
        "_sync",
        "_window",
        "decided_pause",
        "turn",
    )

    def __init__(
        self,
        marker: tuple[Any, str],
        autocast: Callable[[], torch.autocast],
        sync: GradSync,
        window: Window,
        buffers: BufferSnapshot | None,
    ) -> None:
        self._marker = marker  # (step, "block"), set in ACTIVE while the block runs
        self._autocast = autocast
        self._sync = sync
        self._window = window
        self._buffers = buffers
        # (ACTIVE's token, autocast, paused sync or None), from enter() to exit().
        self._entered: (
            tuple[Token[tuple[Any, str] | None], torch.autocast, AbstractContextManager[Any] | None]
            | None
        ) = None
        #: Where the micro-step of the explicit form is.
        self.turn = Turn.IDLE
        #: Whether the last ``with step:`` paused gradient sync (its backward's too).
        self.decided_pause = False

    @property
    def awaiting_backward(self) -> bool:
        """From ``with step:`` to its ``step.backward(loss)``: the micro-step's sync is decided."""
        return self.turn is Turn.IN_BLOCK or self.turn is Turn.BACKWARD_DUE

    @property
    def inside(self) -> bool:
        """Inside ``with step:``."""
        return self._entered is not None

    @property
    def paused(self) -> bool:
        """Inside ``with step:``, which paused gradient sync."""
        entered = self._entered
        return entered is not None and entered[2] is not None

    def enter(self) -> None:
        """Enter autocast (and pause gradient sync when this micro-step will not step)."""
        active = ACTIVE.get()
        if active is not None:
            raise misuse.nested_error(active[0] is self._marker[0])
        token = ACTIVE.set(self._marker)
        paused: AbstractContextManager[Any] | None = None
        autocast: torch.autocast | None = None
        try:
            if self._sync.active and not self._window.syncs_next():
                paused = self._sync.paused()
                paused.__enter__()
            autocast = self._autocast()
            autocast.__enter__()
            buffers = self._buffers
            if buffers is not None and not buffers.saved:
                buffers.save()
        except BaseException:
            _unwind(token, autocast, paused, None, None, None)
            raise
        self._entered = (token, autocast, paused)
        self.decided_pause = paused is not None
        self.turn = Turn.IN_BLOCK

    def backward_done(self) -> None:
        """``step.backward(loss)`` ran: the micro-step is counted."""
        self.turn = Turn.BACKWARD_IN_BLOCK if self._entered is not None else Turn.IDLE

    def exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Leave what :meth:`enter` entered; an exception abandons the micro-step."""
        entered, self._entered = self._entered, None
        if exc is not None:
            note_unused_parameters(exc)  # DDP's unused parameters, named
        if exc_type is not None or self.turn is Turn.BACKWARD_IN_BLOCK:
            self.turn = Turn.IDLE
        elif self.turn is Turn.IN_BLOCK:
            self.turn = Turn.BACKWARD_DUE
        if entered is not None:
            _unwind(*entered, exc_type, exc, tb)


def _unwind(
    token: Token[tuple[Any, str] | None],
    autocast: torch.autocast | None,
    paused: AbstractContextManager[Any] | None,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> None:
    """Leave what :meth:`Block.enter` entered, innermost first, each even if another raised."""
    try:
        if autocast is not None:
            autocast.__exit__(exc_type, exc, tb)
    finally:
        try:
            if paused is not None:
                paused.__exit__(exc_type, exc, tb)
        finally:
            ACTIVE.reset(token)
