"""The one walker over user data: shape-preserving moves of nested containers.

:func:`move_root` walks tensors, containers (dict, list, tuple, namedtuple, deque,
set, dataclass, mappings), objects with ``.to()`` (on a shallow copy) and types
registered with :func:`register`, with

* one dispatch table (``_DISPATCH``), keyed by exact type and filled lazily by
  ``_handler_for``, and one table of leaves (:data:`LEAVES`);
* a memo that keeps aliasing (a tensor found twice is moved once) and guards
  against cycles;
* errors that name the path (``obj['a'][1]``);
* a fast path: plain tensors inside plain dicts and lists are handled inline, and
  a flat batch already on the CPU is answered before any walk (:func:`all_on_cpu`).

An unknown object holding tensors is left alone with a
:class:`~cudakit.exceptions.TensorsLeftBehindWarning`, once per type. prefetch uses
the same walk with a :class:`Staging`: it pins, copies and lists the tensors it made.
Handlers for torch objects moved in place (modules, optimizers) are added by
``cudakit.device.handlers`` through :func:`add_special`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import functools
import io
import itertools
import operator
import os
import sys
import types
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NoReturn, cast

import torch

from ._walk import BUSY as _BUSY
from ._walk import Bad, Ctx, Handler, Staging, located
from ._walk import Cycle as _Cycle
from ._walk import busy_or_done as _busy_or_done
from ._walk import meta_copy_error as _meta_copy_error
from .exceptions import TensorsLeftBehindWarning

__all__ = [
    "LEAVES",
    "Bad",
    "Ctx",
    "Flatten",
    "Handler",
    "Staging",
    "Unflatten",
    "add_special",
    "all_on_cpu",
    "device_tensors_in",
    "finish",
    "forget_warnings",
    "located",
    "move",
    "move_root",
    "register",
    "traverse",
]

_Tensor = torch.Tensor
_MAX_CACHED_TYPES = 1024


def move(x: Any, c: Ctx) -> Any:
    h = _DISPATCH.get(type(x))
    return h(x, c) if h is not None else _slow(x, c)


def _leaf(x: Any, c: Ctx) -> Any:
    return x


def _copy(t: torch.Tensor, c: Ctx) -> torch.Tensor:
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
    return new


def _tensor(t: torch.Tensor, c: Ctx) -> torch.Tensor:
    st = c.staging
    if st is not None and not t.is_cpu:
        st.device_tensor_seen()
    if t.device == c.device:
        return t
    hit = c.memo.get(id(t))
    return _copy(t, c) if hit is None else cast(torch.Tensor, hit)


def _param(p: torch.nn.Parameter, c: Ctx) -> torch.Tensor:
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
        new.grad = cast(torch.Tensor, hit) if hit is not None else _copy(grad, c)
    return new


def _sole_references() -> tuple[int, int]:
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


_SOLE_IN_SEQ, _SOLE_IN_DICT = _sole_references()


def _dict(x: dict[Any, Any], c: Ctx) -> Any:
    # The hot path: plain dicts and lists of plain tensors are handled inline, with a
    # single dict lookup on the exact type for everything else (no isinstance chains).
    i = id(x)
    memo, dev, nb, track, inline = c.hot
    hit = memo.get(i)
    if hit is not None:
        if hit is _BUSY:
            raise _Cycle(x)
        return hit
    memo[i] = _BUSY
    out = {}
    changed = False
    get = _get
    refs = sys.getrefcount
    stay = True
    try:
        for k, v in x.items():
            tp = type(v)
            if tp is inline:
                if stay and v.device == dev:  # adaptive, as in _seq
                    out[k] = v
                    continue
                iv = id(v)
                nv = memo.get(iv)
                if nv is None:
                    nv = v.to(dev, non_blocking=True) if nb else v.to(dev)
                    if nv is v:
                        stay = True
                        out[k] = v
                        continue
                    stay = False
                    if refs(v) > _SOLE_IN_DICT:  # may appear again: remember the copy
                        memo[iv] = nv
                    if track:
                        c.sync.add(v.device)
            else:
                h = get(tp)
                nv = h(v, c) if h is not None else _slow(v, c)
                if nv is v:
                    out[k] = v
                    continue
            changed = True
            out[k] = nv
    except (Bad, NotImplementedError) as e:
        raise located(e, f"[{k!r}]", i, c) from None
    res = out if changed else x
    memo[i] = res
    return res


def _seq(x: Iterable[Any], c: Ctx) -> list[Any] | None:
    """Move the items of a list, tuple or deque; None when no item changed."""
    out: list[Any] = []
    append = out.append
    get = _get
    memo, dev, nb, track, inline = c.hot
    refs = sys.getrefcount
    stay = True
    changed = False
    try:
        for v in x:
            tp = type(v)
            if tp is inline:
                # Adaptive: while tensors are found already in place, a cheap device
                # check skips Tensor.to; once they move, go straight to Tensor.to
                # (which returns the tensor itself when it is already there).
                if stay and v.device == dev:
                    append(v)
                    continue
                iv = id(v)
                nv = memo.get(iv)
                if nv is None:
                    nv = v.to(dev, non_blocking=True) if nb else v.to(dev)
                    if nv is v:
                        stay = True
                        append(v)
                        continue
                    stay = False
                    if refs(v) > _SOLE_IN_SEQ:  # may appear again: remember the copy
                        memo[iv] = nv
                    if track:
                        c.sync.add(v.device)
                append(nv)
                changed = True
            else:
                h = get(tp)
                nv = h(v, c) if h is not None else _slow(v, c)
                append(nv)
                if nv is not v:
                    changed = True
    except (Bad, NotImplementedError) as e:
        raise located(e, f"[{len(out)}]", id(x), c) from None
    return out if changed else None


def _list(x: list[Any], c: Ctx) -> Any:
    memo = c.memo
    hit = memo.get(id(x))
    if hit is not None:
        if hit is _BUSY:
            raise _Cycle(x)
        return hit
    memo[id(x)] = _BUSY
    out = _seq(x, c)
    res = x if out is None else out
    c.memo[id(x)] = res
    return res


def _tuple(x: tuple[Any, ...], c: Ctx) -> Any:
    # A tuple cannot contain itself without a mutable container in between, so the
    # cycle guard of that container is enough; tuples are still memoised for aliasing.
    hit = c.memo.get(id(x))
    if hit is not None and hit is not _BUSY:
        return hit
    out = _seq(x, c)
    res = x if out is None else tuple(out)
    c.memo[id(x)] = res
    return res


def _rebuild_failed(x: object, how: str, err: Exception) -> Bad:
    name = type(x).__name__
    return Bad(
        TypeError,
        f"on_device() moved the tensors inside the {name} at {{where}} but cannot rebuild a "
        f"{name} from them: {how} raised {type(err).__name__}: {err}. Give {name} a "
        "`.to(device, non_blocking=False)` method that returns the moved object, or pass a "
        "plain dict/list/tuple instead.",
    )


def _rebuilt(x: object, c: Ctx, how: str, build: Callable[[], Any]) -> Any:
    """The moved copy of container ``x`` that ``build()`` makes, memoised.

    A failure becomes a ``TypeError`` that names the container, where it is and ``how``.
    """
    try:
        res = build()
    except Exception as err:
        raise _rebuild_failed(x, how, err) from None
    c.memo[id(x)] = res
    return res


def _unchanged(x: object, c: Ctx) -> Any:
    c.memo[id(x)] = x
    return x


def _tuple_subclass(x: tuple[Any, ...], c: Ctx) -> Any:
    # namedtuples are rebuilt from their fields, other tuple subclasses from an iterable
    hit = c.memo.get(id(x))
    if hit is not None and hit is not _BUSY:
        return hit
    out = _seq(x, c)
    if out is None:
        return _unchanged(x, c)
    tp = type(x)
    if hasattr(tp, "_fields"):
        return _rebuilt(x, c, f"{tp.__name__}(*fields)", lambda: tp(*out))

    def build() -> Any:
        res = tp(out)  # its own constructor (a refusal is reported), then its attributes
        _copy_attributes(x, res)
        return res

    return _rebuilt(x, c, f"{tp.__name__}(items)", build)


def _cached_properties(tp: type) -> tuple[str, ...]:
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


def _copy_attributes(src: Any, dst: Any) -> None:
    """The instance attributes of ``src`` onto ``dst``, less stale cached properties."""
    state = getattr(src, "__dict__", None)
    if state:
        dst.__dict__.update(state)
        _drop_stale(dst)


def _drop_stale(res: Any) -> None:
    """Drop values a ``functools.cached_property`` computed from the old items."""
    stale = _cached_properties(type(res))
    state = getattr(res, "__dict__", None) if stale else None
    if isinstance(state, dict):
        for name in stale:
            state.pop(name, None)


def _shallow_copy(x: Any, assign: Callable[[Any], None]) -> Any:
    # copy.copy keeps instance attributes (and a defaultdict's factory) and does not run
    # __init__ again; `assign` writes the moved items into the copy. Values cached by a
    # functools.cached_property were computed from the old items: the copy drops them,
    # so they are computed again, from the moved items, when first read.
    res = copy.copy(x)
    assign(res)
    _drop_stale(res)
    return res


def _list_subclass(x: list[Any], c: Ctx) -> Any:
    hit = _busy_or_done(x, c)
    if hit is not _BUSY:
        return hit
    out = _seq(x, c)
    if out is None:
        return _unchanged(x, c)

    def assign(res: list[Any]) -> None:
        res[:] = out

    return _rebuilt(x, c, "copy.copy(obj)[:] = items", lambda: _shallow_copy(x, assign))


def _mapping_items(x: Mapping[Any, Any], c: Ctx) -> dict[Any, Any] | None:
    """Move the values of a mapping; the changed ones, or None when nothing changed."""
    i = id(x)
    changed: dict[Any, Any] = {}
    get = _DISPATCH.get
    keep = c.keep
    try:
        for k, v in x.items():
            keep.append(v)  # a custom mapping may make its values on the fly
            h = get(type(v))
            nv = h(v, c) if h is not None else _slow(v, c)
            if nv is not v:
                changed[k] = nv
    except (Bad, NotImplementedError) as e:
        raise located(e, f"[{k!r}]", i, c) from None
    return changed or None


def _dict_subclass(x: dict[Any, Any], c: Ctx) -> Any:
    # OrderedDict, defaultdict (keeps default_factory), and user dict subclasses (keeps
    # their instance attributes): a shallow copy with the moved values written back.
    hit = _busy_or_done(x, c)
    if hit is not _BUSY:
        return hit
    changed = _mapping_items(x, c)
    if changed is None:
        return _unchanged(x, c)

    def assign(res: dict[Any, Any]) -> None:
        for k, nv in changed.items():
            res[k] = nv

    return _rebuilt(x, c, "copy.copy(obj)[key] = value", lambda: _shallow_copy(x, assign))


def _mapping(x: Mapping[Any, Any], c: Ctx) -> Any:
    hit = _busy_or_done(x, c)
    if hit is not _BUSY:
        return hit
    changed = _mapping_items(x, c)
    if changed is None:
        return _unchanged(x, c)
    items = {k: changed.get(k, v) for k, v in x.items()}
    return _rebuilt(x, c, f"{type(x).__name__}(dict)", lambda: type(x)(items))  # type: ignore[call-arg]


def _set(x: set[Any] | frozenset[Any], c: Ctx) -> Any:
    hit = _busy_or_done(x, c)
    if hit is not _BUSY:
        return hit
    try:
        out = [move(v, c) for v in x]
    except (Bad, NotImplementedError) as e:
        raise located(e, "{...}", id(x), c) from None
    if all(map(operator.is_, out, x)):
        return _unchanged(x, c)
    return _rebuilt(x, c, f"{type(x).__name__}(items)", lambda: type(x)(out))


def _dataclass(x: Any, c: Ctx) -> Any:
    hit = _busy_or_done(x, c)
    if hit is not _BUSY:
        return hit
    updates: list[tuple[str, Any]] = []
    name = ""
    try:
        for f in dataclasses.fields(x):
            name = f.name
            try:
                v = getattr(x, name)
            except AttributeError:  # an init=False field that was never set
                continue
            nv = move(v, c)
            if nv is not v:
                updates.append((name, nv))
    except (Bad, NotImplementedError) as e:
        raise located(e, f".{name}", id(x), c) from None
    if not updates:
        return _unchanged(x, c)

    def assign(res: Any) -> None:
        # object.__setattr__ also works for frozen and slotted dataclasses
        for field, nv in updates:
            object.__setattr__(res, field, nv)

    how = "copy.copy(obj) and setting its fields"
    return _rebuilt(x, c, how, lambda: _shallow_copy(x, assign))


def _deque(x: collections.deque[Any], c: Ctx) -> Any:
    hit = _busy_or_done(x, c)
    if hit is not _BUSY:
        return hit
    out = _seq(x, c)
    if out is None:
        return _unchanged(x, c)
    if type(x) is collections.deque:
        return _rebuilt(x, c, "deque(items, maxlen)", lambda: collections.deque(out, x.maxlen))

    def build() -> Any:
        tp = type(x)
        res = tp.__new__(tp)
        collections.deque.__init__(res, out, x.maxlen)
        _copy_attributes(x, res)
        return res

    return _rebuilt(x, c, f"{type(x).__name__}.__new__ and deque.__init__", build)


def _duck(x: Any, c: Ctx) -> Any:
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


def _attributes(x: object) -> dict[str, Any]:
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


def _set_attributes(x: Any, moved: Mapping[str, Any]) -> Any:
    def assign(res: Any) -> None:
        for name, value in moved.items():
            object.__setattr__(res, name, value)

    return _shallow_copy(x, assign)


Flatten = Callable[[Any], Mapping[Any, Any]]
Unflatten = Callable[[Any, dict[Any, Any]], Any]


class _Registered:
    """The handler of a type registered with :func:`register`."""

    __slots__ = ("flatten", "unflatten")

    def __init__(self, flatten: Flatten, unflatten: Unflatten) -> None:
        self.flatten = flatten
        self.unflatten = unflatten

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
            c.keep.append(children)
        except Exception as err:
            raise Bad(
                TypeError,
                f"on_device() cannot take apart the {name} at {{where}}: the flatten "
                f"registered for it raised {type(err).__name__}: {err}. flatten(obj) must "
                "return a dict of the values to move, e.g. {'x': obj.x}.",
            ) from None
        moved: dict[Any, Any] = {}
        changed = False
        key: Any = None
        try:
            for key, v in items:
                nv = moved[key] = move(v, c)
                changed = changed or nv is not v
        except (Bad, NotImplementedError) as e:
            step = f".{key}" if isinstance(key, str) and key.isidentifier() else f"[{key!r}]"
            raise located(e, step, id(x), c) from None
        if not changed:
            return _unchanged(x, c)
        return _rebuilt(x, c, "the unflatten registered for it", lambda: self.unflatten(x, moved))


_REGISTERED: dict[type, _Registered] = {}


def register(tp: type, flatten: Flatten | None, unflatten: Unflatten | None) -> None:
    """Walk instances of ``tp`` (and subclasses) through ``flatten``/``unflatten``.

    Defaults: the instance attributes (``__dict__`` and ``__slots__``) in, a shallow
    copy with the moved attributes set out.
    """
    _REGISTERED[tp] = _Registered(flatten or _attributes, unflatten or _set_attributes)
    _WARNED.discard(tp)
    _forget_cached_handlers()


_PROBE_DEPTH = 6


def _holds_tensor(x: object, depth: int) -> bool:
    """Whether a tensor is reachable from ``x`` within ``depth`` levels.

    A cheap probe, bounded to the first ``_PROBE_WIDTH`` values at each level, so an
    unknown object that holds a large structure (a logger's registry) costs little.
    """
    if isinstance(x, _Tensor):
        return True
    if depth == 0 or isinstance(x, LEAVES):
        return False
    if isinstance(x, Mapping):
        values: Iterable[Any] = x.values()
    elif isinstance(x, (list, tuple, set, frozenset, collections.deque)):
        values = x
    else:
        values = _attributes(x).values()
    return any(_holds_tensor(v, depth - 1) for v in itertools.islice(values, _PROBE_WIDTH))


_PROBE_WIDTH = 64


_WARNED: set[type] = set()


def forget_warnings() -> None:
    """Warn again for every type (tests: each starts as a fresh process would)."""
    _WARNED.clear()
    _forget_cached_handlers()


def _unknown(x: Any, c: Ctx) -> Any:
    """An object of a type the walker does not know: left alone, with a warning if it
    holds tensors (once per type)."""
    tp = type(x)
    if tp not in _WARNED and _holds_tensor(x, _PROBE_DEPTH):
        _WARNED.add(tp)
        _DISPATCH[tp] = _leaf  # warned once: from now on a plain leaf
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
            stacklevel=_user_stacklevel(),
        )
    return x


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _user_stacklevel() -> int:
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


def _reject_loader(x: Any, c: Ctx) -> NoReturn:
    raise Bad(
        TypeError,
        f"on_device() cannot move a {type(x).__name__} (found at {{where}}): a loader makes "
        f"batches, it does not hold them. {_PREFETCH_HINT}",
    )


def _reject_iterator(x: Any, c: Ctx) -> NoReturn:
    kind = (
        "a generator" if isinstance(x, types.GeneratorType) else f"an iterator ({type(x).__name__})"
    )
    raise Bad(
        TypeError,
        f"on_device() cannot move {kind} (found at {{where}}): its items are produced "
        f"lazily and moving them would consume it. {_PREFETCH_HINT}",
    )


def _handler_for(tp: type) -> Handler:
    from torch.utils.data import DataLoader

    if issubclass(tp, torch.nn.Parameter):
        return _param
    if issubclass(tp, torch.Tensor):
        return _tensor
    for base, handler in _SPECIAL:
        if issubclass(tp, base):
            return handler
    for base in tp.__mro__:
        registered = _REGISTERED.get(base)
        if registered is not None:
            return registered
    if issubclass(tp, LEAVES):
        return _leaf
    if issubclass(tp, DataLoader):
        return _reject_loader
    if issubclass(tp, (types.GeneratorType, types.AsyncGeneratorType)) or (
        issubclass(tp, Iterator) and not issubclass(tp, io.IOBase)
    ):
        return _reject_iterator
    if issubclass(tp, collections.UserDict):
        return _dict_subclass  # transformers' BatchEncoding: walked, not moved in place
    if callable(getattr(tp, "to", None)):
        return _duck
    if issubclass(tp, tuple):
        return _tuple_subclass
    if issubclass(tp, dict):
        return _dict_subclass
    if issubclass(tp, Mapping):
        return _mapping
    if issubclass(tp, list):
        return _list_subclass
    if issubclass(tp, (set, frozenset)):
        return _set
    if issubclass(tp, collections.deque):
        return _deque
    if dataclasses.is_dataclass(tp):
        return _dataclass
    return _unknown if _has_attributes(tp) else _leaf


def _has_attributes(tp: type) -> bool:
    """Whether instances of ``tp`` can hold values (a ``__dict__`` or ``__slots__``)."""
    return bool(getattr(tp, "__dictoffset__", 0)) or any(
        klass.__dict__.get("__slots__") for klass in tp.__mro__
    )


_SPECIAL: list[tuple[type, Handler]] = []


def add_special(tp: type, handler: Handler) -> None:
    """Handle instances of ``tp`` (and its subclasses) with ``handler``, before containers."""
    _SPECIAL.append((tp, handler))
    _forget_cached_handlers()


def _forget_cached_handlers() -> None:
    for cached in [t for t in _DISPATCH if t not in _SEED]:
        del _DISPATCH[cached]


def _slow(x: Any, c: Ctx) -> Any:
    tp = type(x)
    h = _handler_for(tp)
    if len(_DISPATCH) < _MAX_CACHED_TYPES:
        _DISPATCH[tp] = h
    return h(x, c)


#: The one table of leaves: values that hold no tensor and come back as themselves
#: (subclasses too: an IntEnum, a metaclass). A class, a function or a module is never
#: a container, even though it has attributes.
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

_DISPATCH: dict[type, Handler] = {
    torch.Tensor: _tensor,
    torch.nn.Parameter: _param,
    dict: _dict,
    list: _list,
    tuple: _tuple,
    set: _set,
    frozenset: _set,
    OrderedDict: _dict_subclass,
    defaultdict: _dict_subclass,
    collections.deque: _deque,
    **dict.fromkeys(LEAVES, _leaf),
}


_SEED = frozenset(_DISPATCH)
_get = _DISPATCH.get  # the dict is only ever changed in place


def finish(c: Ctx) -> None:
    for action in c.pending:
        action()
    for dev in c.sync:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elif dev.type == "mps":
            torch.mps.synchronize()


def traverse(x: Any, c: Ctx, root: str) -> Any:
    """Move ``x`` within ``c``, turning internal errors into the user-facing ones."""
    try:
        return move(x, c)
    except (Bad, NotImplementedError) as e:
        bad = e if isinstance(e, Bad) else _meta_copy_error(e, c)
        raise bad.exc_type(bad.render(root)) from bad.cause
    except RecursionError:
        raise ValueError(
            f"on_device() cannot walk {root}: it is nested deeper than Python's recursion "
            f"limit ({sys.getrecursionlimit()}) allows. Flatten the structure, or raise the "
            "limit with sys.setrecursionlimit(...)."
        ) from None


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


def move_root(
    x: Any,
    device: torch.device,
    non_blocking: bool | None,
    root: str,
    staging: Staging | None = None,
) -> Any:
    """Move ``x`` (called ``root`` in error messages) to ``device``: one whole walk."""
    if staging is None and device.type == "cpu" and all_on_cpu(x):
        return x
    c = Ctx(device, non_blocking, staging)
    out = traverse(x, c, root)
    finish(c)
    return out


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
    elif not _has_attributes(type(obj)):
        return False  # a C object: not searchable
    else:
        values = _attributes(obj).values()
    complete = True
    for v in values:
        if not device_tensors_in(v, out, seen):
            complete = False
    return complete
