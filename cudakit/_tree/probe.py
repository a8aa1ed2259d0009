"""The probe that finds tensors a walk left behind, and the warnings that say so.

An unknown object (:func:`warn_left_behind`) or a registered type whose flatten
missed an attribute (:func:`warn_missed`) is searched a few levels deep, once per type.
"""

from __future__ import annotations

import collections
import itertools
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._stacklevel import user_stacklevel
from ..exceptions import TensorsLeftBehindWarning
from .leaves import LEAVES
from .rebuild import attributes

__all__ = [
    "PROBE_DEPTH",
    "holds_tensor",
    "warn_left_behind",
    "warn_missed",
]

_Tensor = torch.Tensor


def warn_left_behind(
    unknown: Iterable[Any], seen: Mapping[int, Any], warned: set[type]
) -> list[type]:
    """Warn (once per type: ``warned``) for the ``unknown`` objects holding tensors that the
    walk (its memo: ``seen``) did not reach; returns the types warned about now.

    Modules, optimizers and tensors the call moved are not probed into: an LR scheduler
    (its optimizer) or a helper holding the model reaches only what was moved.
    """
    now: list[type] = []
    for x in unknown:
        tp = type(x)
        try:
            holds = tp not in warned and holds_tensor(x, PROBE_DEPTH, seen)
        except Exception:  # an object whose attributes raise: nothing to say about it
            holds = False
        if holds:
            warned.add(tp)
            now.append(tp)
            _warn_unknown(tp)
    return now


def _warn_unknown(tp: type) -> None:
    name = tp.__name__
    warnings.warn(
        TensorsLeftBehindWarning(
            f"on_device() left the tensors inside a {tp.__module__}.{tp.__qualname__} "
            f"where they were: cudakit does not know how to rebuild a {name}, so it "
            f"comes back unchanged. Register the type once with "
            f"`cudakit.register_container({name})` (its attributes are then moved), give "
            "it a `.to(device)` method, or keep the tensors in a dict or dataclass. "
            "This warning is shown once per type."
        ),
        stacklevel=user_stacklevel(),
    )


def warn_missed(tp: type, missed: list[str]) -> None:
    name = tp.__name__
    which = ", ".join(map(repr, missed))
    head = f"attribute {which} holds" if len(missed) == 1 else f"attributes {which} hold"
    warnings.warn(
        TensorsLeftBehindWarning(
            f"on_device() left tensors behind inside a {tp.__module__}.{tp.__qualname__}: its "
            f"{head} tensors that the flatten registered for {name} does not return, so they "
            "stayed where they were. If that is a mistake (a typo, a forgotten key), add them "
            "to flatten's dict (and let unflatten set them); if it is on purpose, silence this "
            "with warnings.filterwarnings('ignore', category=cudakit.TensorsLeftBehindWarning). "
            "This warning is shown once per type."
        ),
        stacklevel=user_stacklevel(),
    )


PROBE_DEPTH = 6


def holds_tensor(
    x: object,
    depth: int,
    seen: Mapping[int, Any] | None = None,
    *,
    away_from: torch.device | None = None,
) -> bool:
    """Whether a tensor (one not on ``away_from``, if given) is reachable from ``x``
    within ``depth`` levels.

    A cheap probe, bounded to the first ``_PROBE_WIDTH`` values at each level, so an
    unknown object that holds a large structure (a logger's registry) costs little.
    Objects the walk kept as themselves (``seen``, its memo: modules and optimizers
    moved in place, tensors already there) hold nothing left behind; a tensor the walk
    copied is still the old one here.
    """
    if seen is not None and seen.get(id(x)) is x:
        return False
    if isinstance(x, _Tensor):
        return away_from is None or x.device != away_from
    if depth == 0 or isinstance(x, LEAVES):
        return False
    if isinstance(x, Mapping):
        values: Iterable[Any] = x.values()
    elif isinstance(x, (list, tuple, set, frozenset, collections.deque)):
        values = x
    else:
        values = attributes(x).values()
    return any(
        holds_tensor(v, depth - 1, seen, away_from=away_from)
        for v in itertools.islice(values, _PROBE_WIDTH)
    )


_PROBE_WIDTH = 64
