"""When a save is due: every ``every`` windows, on request, and never twice at one place.

:class:`SavePolicy` owns what the decision needs: the batch checked last (a boundary
is looked at once per batch), the position saved last, and a pending request (a
``save()`` called inside a window, taken at its end). The
:class:`~cudakit.checkpoint._saver.Saver` asks it at each window boundary.
"""

from __future__ import annotations

from .data import Position

__all__ = ["SavePolicy"]


class SavePolicy:
    """Whether a save is due at a boundary, and what was saved last."""

    def __init__(self, every: int | None) -> None:
        #: Save every ``every`` windows (None: only on request, a stop, or the run's end).
        self.every = every
        #: A ``save()`` asked for inside a window, taken at its end.
        self.requested = False
        self._checked_total = -1
        self._saved_total = -1
        self._saved_windows = 0

    def first_look(self, pos: Position) -> bool:
        """Whether ``pos`` is a batch whose boundary was not looked at yet (then it is)."""
        if pos.total == self._checked_total:
            return False
        self._checked_total = pos.total
        return True

    def due(self, pos: Position) -> bool:
        """Whether ``every`` windows passed since the last save, or a save was asked for."""
        return self.requested or (
            self.every is not None and pos.windows - self._saved_windows >= self.every
        )

    def unsaved(self, pos: Position) -> bool:
        """Whether ``pos`` differs from the position saved last."""
        return pos.total != self._saved_total

    def saved_just_before(self, pos: Position) -> bool:
        """Whether the last save is ``pos`` less its batch not yet stepped."""
        return pos.total - 1 == self._saved_total

    def saved(self, pos: Position) -> None:
        """A save of ``pos`` was taken."""
        self.requested = False
        self._saved_total = pos.total
        self._saved_windows = pos.windows

    def restored(self, pos: Position) -> None:
        """The run continues from a checkpoint of ``pos``: it counts as saved and looked at."""
        self._checked_total = self._saved_total = pos.total
        self._saved_windows = pos.windows
