"""Adding a note to an exception that goes on unchanged (PEP 678), where Python has notes."""

from __future__ import annotations

__all__ = ["add_note"]


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` on Python 3.11+; nothing on older versions."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
