"""Objects moved by their own ``.to()``: called on a shallow copy, memoised."""

from __future__ import annotations

import copy
from typing import Any

from .context import Ctx
from .errors import BUSY

__all__ = [
    "move_duck",
]


def move_duck(x: Any, c: Ctx) -> Any:
    """An object with its own ``.to()``: called on a shallow copy, memoised."""
    hit = c.memo.get(id(x))
    if hit is not None and hit is not BUSY:
        return hit
    # .to() is called on a shallow copy, so an object that moves in place (PyG's Data)
    # leaves the caller's object as it was; a .to() that returns None moved the copy.
    st = c.staging
    pin = getattr(x, "pin_memory", None) if st is not None and st.pin else None
    try:
        # The DataLoader's protocol for custom batches: pin_memory() returns a new object.
        target = pin() if callable(pin) else copy.copy(x)
    except Exception:  # an object copy cannot handle: moved as it is
        target = x
    # When the caller forced non_blocking towards the CPU we cannot know which streams an
    # arbitrary .to() used, so such objects are copied synchronously (always safe to read).
    nb = c.nb and not c.track
    try:
        res = target.to(c.device, non_blocking=nb)
    except TypeError as err:
        # Only a .to() that does not take non_blocking is called again without it; any
        # other TypeError is the object's own and must not be hidden by a second call.
        if "non_blocking" not in str(err):
            raise
        res = target.to(c.device)
    if res is None:
        res = target
    if st is not None:
        st.opaque.append(res)
    c.memo[id(x)] = res
    return res
