"""Types registered with :func:`cudakit.register_container`: taken apart by their flatten,
rebuilt by their unflatten, and checked for tensors the flatten missed.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import probe
from .context import Ctx, Handler
from .errors import BUSY, Bad, busy_or_done, located
from .rebuild import attributes, rebuilt, unchanged

__all__ = [
    "Flatten",
    "Registered",
    "Unflatten",
]

Flatten = Callable[[Any], Mapping[Any, Any]]


Unflatten = Callable[[Any, dict[Any, Any]], Any]


class Registered:
    """The handler of a type registered with :func:`register`.

    A ``flatten`` of the user's own may miss a field (a typo, a forgotten key): until it
    has warned once, each object it takes apart is checked for attributes that hold
    tensors away from the target and that flatten did not return (:meth:`left_behind`).
    The default flatten returns every attribute, so it is never checked. Under the
    default unflatten (``named``), which sets each key as an attribute, a key that is
    no attribute of the object would build a wrong one: refused before anything moves.
    """

    __slots__ = ("check", "flatten", "named", "unflatten", "walk")

    def __init__(
        self,
        flatten: Flatten,
        unflatten: Unflatten,
        walk: Handler,
        *,
        check: bool,
        named: bool = False,
    ) -> None:
        self.flatten = flatten
        self.unflatten = unflatten
        self.walk = walk  # the walker's dispatch, for the children
        self.check = check  # look for tensors flatten missed (until warned once)
        self.named = named  # flatten's keys must be the object's attributes

    def __call__(self, x: Any, c: Ctx) -> Any:
        hit = busy_or_done(x, c)
        if hit is not BUSY:
            return hit
        name = type(x).__name__
        try:
            children = self.flatten(x)
            items = list(children.items())
            # flatten may build new objects (a list, a .detach()); keep them alive until
            # the walk ends, or their ids could be reused by the next object's and the
            # memo would hand back the wrong moved value.
            c.kept().append(children)
        except Exception as err:
            raise Bad(
                TypeError,
                f"on_device() cannot take apart the {name} at {{where}}: the flatten "
                f"registered for it raised {type(err).__name__}: {err}. flatten(obj) must "
                "return a dict of the values to move, e.g. {'x': obj.x}.",
            ) from None
        if self.named:
            stray = stray_keys(x, children)
            if stray:
                raise Bad(ValueError, _stray_message(x, stray))
        moved: dict[Any, Any] = {}
        changed = False
        key: Any = None
        try:
            for key, v in items:
                nv = moved[key] = self.walk(v, c)
                changed = changed or nv is not v
        except (Bad, NotImplementedError) as e:
            step = f".{key}" if isinstance(key, str) and key.isidentifier() else f"[{key!r}]"
            raise located(e, step, id(x), c) from None
        if not changed:
            res = unchanged(x, c)
        else:
            res = rebuilt(x, c, "the unflatten registered for it", lambda: self.unflatten(x, moved))
            if res is None:
                raise Bad(
                    TypeError,
                    f"on_device() moved the tensors inside the {name} at {{where}} but the "
                    f"unflatten registered for {name} returned None. unflatten(obj, moved) must "
                    "return the new object, e.g. `return copy` at the end of a function that "
                    f"sets the moved values on a copy, or `lambda obj, moved: {name}(**moved)`.",
                )
        if self.check:
            self.left_behind(type(x), res, moved, c)
        return res

    def left_behind(self, tp: type, res: Any, moved: Mapping[Any, Any], c: Ctx) -> None:
        """Warn (once per registration) when ``res`` holds tensors flatten did not return.

        Only attributes that are not among the moved values are probed, for a tensor
        that is not on the target: the ones the walk moved, or kept as themselves
        (modules moved in place), do not count.
        """
        done = {id(v) for v in moved.values()}
        seen = c.memo
        device = c.device
        missed = sorted(
            str(name)
            for name, v in attributes(res).items()
            if id(v) not in done
            and probe.holds_tensor(v, probe.PROBE_DEPTH, seen, away_from=device)
        )
        if missed:
            self.check = False
            c.defer(lambda: probe.warn_missed(tp, missed))


def stray_keys(x: object, keys: Iterable[Any]) -> list[Any]:
    """The keys that are no instance attribute of ``x`` (its ``__dict__`` or set slots)."""
    state = getattr(x, "__dict__", None)
    names: dict[str, Any] | None = None
    out = []
    for key in keys:
        if isinstance(state, dict) and key in state:
            continue
        if names is None:
            names = attributes(x)
        if not (isinstance(key, str) and key in names):
            out.append(key)
    return out


def _stray_message(x: object, stray: list[Any]) -> str:
    name = type(x).__name__
    keys = ", ".join(map(repr, stray))
    which = "which is no attribute" if len(stray) == 1 else "which are no attributes"
    have = ", ".join(map(repr, sorted(attributes(x)))) or "none"
    close = difflib.get_close_matches(str(stray[0]), sorted(attributes(x)), n=1)
    example = close[0] if close else next(iter(sorted(attributes(x))), "x")
    return (
        f"on_device() cannot rebuild the {name} at {{where}}: the flatten registered for it "
        f"returned {keys}, {which} of it (its attributes: {have}), and the default "
        "unflatten sets each key as an attribute. Return attribute names from flatten, e.g. "
        f"{{{example!r}: obj.{example}}}, or register an unflatten of your own."
    )
