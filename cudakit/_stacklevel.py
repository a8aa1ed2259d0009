"""The ``stacklevel`` that points a warning at the user's code, outside cudakit."""

from __future__ import annotations

import os
import sys

__all__ = ["user_stacklevel"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside cudakit."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
