"""The walker's work on one object, without its dispatch: what :mod:`cudakit._tree` calls.

Tensors and Parameters copied to the target through the memo; shallow copies of
containers and objects with their attributes set (cached properties computed from the
old items dropped); the rebuild of a moved container and its error; the handler of
registered types (given the walk for their children); the probe that finds tensors an
unknown object would leave behind; the scans prefetch runs (a flat CPU batch, the CUDA
tensors a ``.to()`` made); and the refusals of loaders and iterators.
"""

from __future__ import annotations

import collections
import copy
import difflib
import enum
import functools
import itertools
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn, cast

import torch

from ._walk import BUSY as _BUSY
from ._walk import Bad, Ctx, Handler, located
from ._walk import busy_or_done as _busy_or_done
from .exceptions import TensorsLeftBehindWarning

__all__ = [
    "LEAVES",
    "PROBE_DEPTH",
    "SOLE_IN_DICT",
    "SOLE_IN_SEQ",
    "Flatten",
    "Registered",
    "Unflatten",
    "all_on_cpu",
    "attributes",
    "copy_attributes",
    "copy_tensor",
    "device_tensors_in",
    "drop_stale",
    "has_attributes",
    "holds_tensor",
    "move_duck",
    "move_param",
    "move_tensor",
    "rebuild_failed",
    "rebuilt",
    "reject_iterator",
    "reject_loader",
    "set_attributes",
    "shallow_copy",
    "unchanged",
    "user_stacklevel",
    "warn_left_behind",
]

_Tensor = torch.Tensor


def copy_tensor(t: torch.Tensor, c: Ctx) -> torch.Tensor:
    """Copy one tensor that is not on the target yet (callers checked memo and device)."""
    if c.track:
        c.sync.add(t.device)
    st = c.staging
    if st is None:
        # Passing non_blocking only when it is True keeps the common call cheap.
        new = t.to(c.device, non_blocking=True) if c.nb else t.to(c.device)
    else:
        src = t
        if (
            st.pin
            and t.is_cpu
            and type(t) is _Tensor
            and t.layout is torch.strided
            and not t.is_nested
            and not t.is_pinned()
        ):
            src = t.pin_memory()
        new = src.to(c.device, non_blocking=c.nb)
        st.created.append(new)
    c.memo[id(t)] = new
    c.loose = True  # the inline paths of the walk must look tensors up from now on
    return new


def move_tensor(t: torch.Tensor, c: Ctx) -> torch.Tensor:
    st = c.staging
    if st is not None and not t.is_cpu:
        st.device_tensor_seen()
    if t.device == c.device:
        return t
    hit = c.memo.get(id(t))
    return copy_tensor(t, c) if hit is None else cast(torch.Tensor, hit)


def move_param(p: torch.nn.Parameter, c: Ctx) -> torch.Tensor:
    st = c.staging
    if st is not None and not p.is_cpu:
        st.device_tensor_seen()
    if p.device == c.device:
        return p
    hit = c.memo.get(id(p))
    if hit is not None:
        return cast(torch.Tensor, hit)
    if c.track:
        c.sync.add(p.device)
    # Tensor.to on a Parameter returns a plain non-leaf tensor; rebuild the Parameter
    # (as Module.to does), keeping requires_grad and moving an accumulated .grad along.
    c.loose = True  # a Parameter (and its .grad) in the memo: see copy_tensor
    if type(p).to is not torch.nn.Parameter.to:  # a subclass that moves itself
        moved = p.to(c.device, non_blocking=True) if c.nb else p.to(c.device)
        c.memo[id(p)] = moved
        return moved
    new = torch.nn.Parameter(p.detach().to(c.device, non_blocking=c.nb), p.requires_grad)
    if type(p) is not torch.nn.Parameter:
        new.__class__ = type(p)  # a Parameter subclass stays one
    state = getattr(p, "__dict__", None)
    if state:
        new.__dict__.update(state)  # attributes set on the parameter (tp_rank=...)
    if st is not None:
        st.created.append(new)
    c.memo[id(p)] = new
    if p.grad is not None:
        # Through the memo: a .grad that also appears elsewhere stays one tensor.
        grad = p.grad
        hit = c.memo.get(id(grad))
        new.grad = cast(torch.Tensor, hit) if hit is not None else copy_tensor(grad, c)
    return new


def sole_references() -> tuple[int, int]:
    """``sys.getrefcount`` of a value held by nothing but the container being walked.

    Measured with the very loops of _seq and _dict, so it holds on any Python. The
    inline paths memoise a moved tensor only when it has more references than that:
    a tensor found a second time in the input is held by at least two container
    slots, so it always had more, and one held once (the common case) costs no memo
    write. Lookups still run for every tensor.
    """
    seq = dct = 0
    for v in [object()]:
        seq = sys.getrefcount(v)
    for _k, v in {0: object()}.items():
        dct = sys.getrefcount(v)
    return seq, dct


SOLE_IN_SEQ, SOLE_IN_DICT = sole_references()


def rebuild_failed(x: object, how: str, err: Exception) -> Bad:
    name = type(x).__name__
    return Bad(
        TypeError,
        f"on_device() moved the tensors inside the {name} at {{where}} but cannot rebuild a "
        f"{name} from them: {how} raised {type(err).__name__}: {err}. Give {name} a "
        "`.to(device, non_blocking=False)` method that returns the moved object, or pass a "
        "plain dict/list/tuple instead.",
    )


def rebuilt(x: object, c: Ctx, how: str, build: Callable[[], Any]) -> Any:
    """The moved copy of container ``x`` that ``build()`` makes, memoised.

    A failure becomes a ``TypeError`` that names the container, where it is and ``how``.
    """
    try:
        res = build()
    except Exception as err:
        raise rebuild_failed(x, how, err) from None
    c.memo[id(x)] = res
    return res


def unchanged(x: object, c: Ctx) -> Any:
    c.memo[id(x)] = x
    return x


def cached_properties(tp: type) -> tuple[str, ...]:
    names = _CACHED_PROPERTIES.get(tp)
    if names is None:
        names = _CACHED_PROPERTIES[tp] = tuple(
            name
            for klass in tp.__mro__
            for name, attr in vars(klass).items()
            if isinstance(attr, functools.cached_property)
        )
    return names


_CACHED_PROPERTIES: dict[type, tuple[str, ...]] = {}


def copy_attributes(src: Any, dst: Any) -> None:
    """The instance attributes of ``src`` onto ``dst``, less stale cached properties."""
    state = getattr(src, "__dict__", None)
    if state:
        dst.__dict__.update(state)
        drop_stale(dst)


def drop_stale(res: Any) -> None:
    """Drop values a ``functools.cached_property`` computed from the old items."""
    stale = cached_properties(type(res))
    state = getattr(res, "__dict__", None) if stale else None
    if isinstance(state, dict):
        for name in stale:
            state.pop(name, None)


def shallow_copy(x: Any, assign: Callable[[Any], None]) -> Any:
    # copy.copy keeps instance attributes (and a defaultdict's factory) and does not run
    # __init__ again; `assign` writes the moved items into the copy. Values cached by a
    # functools.cached_property were computed from the old items: the copy drops them,
    # so they are computed again, from the moved items, when first read.
    res = copy.copy(x)
    assign(res)
    drop_stale(res)
    return res


def attributes(x: object) -> dict[str, Any]:
    """An object's instance attributes: its ``__dict__`` and the ``__slots__`` set."""
    found: dict[str, Any] = {}
    state = getattr(x, "__dict__", None)
    if isinstance(state, dict):
        found.update(state)
    for klass in type(x).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in found:
                value = getattr(x, name, _UNSET)
                if value is not _UNSET:  # a slot never set holds nothing
                    found[name] = value
    return found


_UNSET = object()


def set_attributes(x: Any, moved: Mapping[str, Any]) -> Any:
    def assign(res: Any) -> None:
        for name, value in moved.items():
            object.__setattr__(res, name, value)

    return shallow_copy(x, assign)


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
        hit = _busy_or_done(x, c)
        if hit is not _BUSY:
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
            if id(v) not in done and holds_tensor(v, PROBE_DEPTH, seen, away_from=device)
        )
        if missed:
            self.check = False
            c.defer(lambda: _warn_missed(tp, missed))


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


def _warn_missed(tp: type, missed: list[str]) -> None:
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


def move_duck(x: Any, c: Ctx) -> Any:
    """An object with its own ``.to()``: called on a shallow copy, memoised."""
    hit = c.memo.get(id(x))
    if hit is not None and hit is not _BUSY:
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


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside cudakit."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


_PREFETCH_HINT = (
    "Move each batch inside the loop (`for batch in loader: batch = on_device(batch)`), or "
    "wrap the loader with `cudakit.data.prefetch(loader)`, which yields batches already on "
    "the device and overlaps the copies with compute."
)


def reject_loader(x: Any, c: Ctx) -> NoReturn:
    raise Bad(
        TypeError,
        f"on_device() cannot move a {type(x).__name__} (found at {{where}}): a loader makes "
        f"batches, it does not hold them. {_PREFETCH_HINT}",
    )


def reject_iterator(x: Any, c: Ctx) -> NoReturn:
    kind = (
        "a generator" if isinstance(x, types.GeneratorType) else f"an iterator ({type(x).__name__})"
    )
    raise Bad(
        TypeError,
        f"on_device() cannot move {kind} (found at {{where}}): its items are produced "
        f"lazily and moving them would consume it. {_PREFETCH_HINT}",
    )


def has_attributes(tp: type) -> bool:
    """Whether instances of ``tp`` can hold values (a ``__dict__`` or ``__slots__``)."""
    return bool(getattr(tp, "__dictoffset__", 0)) or any(
        klass.__dict__.get("__slots__") for klass in tp.__mro__
    )


LEAVES: tuple[type, ...] = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    range,
    slice,
    type(Ellipsis),
    enum.Enum,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    functools.partial,
    torch.dtype,
    torch.device,
    torch.Size,
    torch.layout,
    torch.memory_format,
)


def all_on_cpu(x: Any) -> bool:
    """Whether ``x`` is a tensor, or a flat dict/list/tuple of tensors, all on the CPU.

    The commonest batch that needs nothing (a CPU loop), answered before any walk.
    """
    tp = type(x)
    values: Iterable[Any]
    if tp is tuple or tp is list:
        values = x
    elif tp is dict:
        values = x.values()
    elif tp is _Tensor:
        return bool(x.is_cpu)
    else:
        return False
    for v in values:  # noqa: SIM110 (a plain loop beats all(genexpr) here)
        if type(v) is not _Tensor or not v.is_cpu:
            return False
    return True


def device_tensors_in(obj: Any, out: list[torch.Tensor], seen: set[int] | None = None) -> bool:
    """Append the CUDA tensors inside ``obj``, an object that its own ``.to()`` made.

    The walk cannot see what such a ``.to()`` created, so prefetch searches the result
    (attributes, mappings, sequences; a back-reference is followed once). Returns False
    when tensors may hide where no search reaches (a closure, an object without
    attributes).
    """
    if seen is None:
        seen = set()
    if isinstance(obj, _Tensor):
        if obj.is_cuda:
            out.append(obj)
        return True
    if callable(obj) and not isinstance(obj, type):
        return False  # a function's closure (or a callable object) may hide tensors
    if isinstance(obj, LEAVES) or id(obj) in seen:
        return True
    seen.add(id(obj))
    values: Iterable[Any]
    if isinstance(obj, Mapping):
        values = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        values = obj
    elif not has_attributes(type(obj)):
        return False  # a C object: not searchable
    else:
        values = attributes(obj).values()
    complete = True
    for v in values:
        if not device_tensors_in(v, out, seen):
            complete = False
    return complete
