"""The walk over user data: one dispatch table and the handlers of containers.

:func:`move_root` walks tensors, containers (dict, list, tuple, namedtuple, deque,
set, dataclass, mappings), objects with ``.to()`` (on a shallow copy) and types
registered with :func:`register`, with

* one dispatch table (``_DISPATCH``), keyed by exact type and filled lazily by
  ``_handler_for``, and one table of leaves (:data:`~cudakit._tree.leaves.LEAVES`);
* a memo that keeps aliasing (a tensor found twice is moved once) and guards
  against cycles;
* errors that name the path (``obj['a'][1]``);
* a fast path: plain tensors inside plain dicts and lists are handled inline, and
  a flat batch already on the CPU is answered before any walk
  (:func:`~cudakit._tree.scans.all_on_cpu`).

An unknown object holding tensors is left alone with a
:class:`~cudakit.exceptions.TensorsLeftBehindWarning`, once per type. prefetch uses
the same walk with a :class:`~cudakit._tree.context.Staging`: it pins, copies and lists
the tensors it made. Handlers for torch objects moved in place (modules, optimizers)
are added by ``cudakit.device._handlers`` through :func:`add_special`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import operator
import sys
import types
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .context import Ctx, Handler, Staging, device_kind
from .duck_typed import move_duck
from .errors import BUSY, Bad, Cycle, busy_or_done, located, user_error
from .leaves import LEAVES
from .probe import warn_left_behind
from .rebuild import (
    attributes,
    copy_attributes,
    has_attributes,
    rebuilt,
    set_attributes,
    shallow_copy,
    unchanged,
)
from .refusals import reject_iterator, reject_loader
from .registered import Flatten, Registered, Unflatten
from .scans import all_on_cpu
from .tensors import SOLE_IN_DICT, SOLE_IN_SEQ, move_param, move_tensor

__all__ = [
    "add_special",
    "finish",
    "forget_warnings",
    "move",
    "move_root",
    "register",
    "traverse",
]

_Tensor = torch.Tensor
_MAX_CACHED_TYPES = 1024


def move(x: Any, c: Ctx) -> Any:
    """Move ``x`` within the walk ``c``: the handler of its exact type, found once."""
    h = _DISPATCH.get(type(x))
    return h(x, c) if h is not None else _slow(x, c)


def _leaf(x: Any, c: Ctx) -> Any:
    return x


def _dict(x: dict[Any, Any], c: Ctx, held_once: bool = False) -> Any:
    # The hot path: plain dicts and lists of plain tensors are handled inline, with a
    # single dict lookup on the exact type for everything else (no isinstance chains).
    # See _seq for the tensor path and for `held_once`; the two differ only in how
    # items are stored.
    memo, dev, nb, track, inline = c.hot
    if not held_once:
        i = id(x)
        hit = memo.get(i)
        if hit is not None:
            if hit is BUSY:
                raise Cycle(x)
            return hit
        memo[i] = BUSY
    out = {}
    changed = False
    get = _get
    leaf = _leaf
    plain_list = _list
    plain_dict = _dict
    seq = _seq
    refs = sys.getrefcount
    sole = SOLE_IN_DICT
    loose = c.loose
    stay = c.stay
    try:
        for k, v in x.items():
            tp = type(v)
            if tp is inline:
                if stay and v.device == dev:
                    out[k] = v
                    continue
                if loose or refs(v) > sole:
                    iv = id(v)
                    nv = memo.get(iv)
                    if nv is None:
                        nv = memo[iv] = v.to(dev, non_blocking=True) if nb else v.to(dev)
                else:
                    nv = v.to(dev, non_blocking=True) if nb else v.to(dev)
                if nv is v:
                    stay = True
                    out[k] = v
                    continue
                stay = False
                if track:
                    c.sync.add(v.device)
            else:
                h = get(tp)
                if h is leaf:
                    out[k] = v
                    continue
                if h is plain_list and refs(v) <= sole:  # held only here: no memo
                    nv = seq(v, c)
                    if nv is None:
                        nv = v
                elif h is plain_dict and refs(v) <= sole:
                    nv = _dict(v, c, True)
                else:
                    nv = h(v, c) if h is not None else _slow(v, c)
                loose = c.loose
                stay = c.stay
                if nv is v:
                    out[k] = v
                    continue
            changed = True
            out[k] = nv
    except (Bad, NotImplementedError) as e:
        raise located(e, f"[{k!r}]", id(x), c) from None
    c.stay = stay
    res = out if changed else x
    if not held_once:
        memo[i] = res
    return res


def _seq(x: Iterable[Any], c: Ctx) -> list[Any] | None:
    """Move the items of a list, tuple or deque; None when no item changed.

    Plain tensors are moved inline (no call per item):

    * adaptive: while tensors are found already in place, a cheap device check skips
      ``Tensor.to``; once they move, straight to ``Tensor.to`` (which returns the tensor
      itself when it is already there). The guess carries over between containers;
    * aliasing: a tensor held once by the input (its reference count says so: see
      ``cudakit._tree.tensors.sole_references``) cannot appear again, so it needs no memo lookup or
      write; one held more than once is looked up and remembered. Once another path has
      put a tensor in the memo (a Parameter's ``.grad``, ``c.loose``), every tensor is
      looked up;
    * a plain list or dict held once cannot appear again either, nor contain itself (a
      cycle is a second reference), so it is walked without the memo.
    """
    out: list[Any] = []
    append = out.append
    get = _get
    leaf = _leaf
    plain_list = _list
    plain_dict = _dict
    seq = _seq
    memo, dev, nb, track, inline = c.hot
    refs = sys.getrefcount
    sole = SOLE_IN_SEQ
    loose = c.loose
    stay = c.stay
    changed = False
    try:
        for v in x:
            tp = type(v)
            if tp is inline:
                if stay and v.device == dev:
                    append(v)
                    continue
                if loose or refs(v) > sole:  # may appear again: through the memo
                    iv = id(v)
                    nv = memo.get(iv)
                    if nv is None:
                        nv = memo[iv] = v.to(dev, non_blocking=True) if nb else v.to(dev)
                else:
                    nv = v.to(dev, non_blocking=True) if nb else v.to(dev)
                if nv is v:
                    stay = True
                    append(v)
                    continue
                stay = False
                if track:
                    c.sync.add(v.device)
                append(nv)
                changed = True
            else:
                h = get(tp)
                if h is leaf:
                    append(v)
                    continue
                if h is plain_list and refs(v) <= sole:  # held only here: no memo
                    nv = seq(v, c)
                    if nv is None:
                        nv = v
                elif h is plain_dict and refs(v) <= sole:
                    nv = _dict(v, c, True)
                else:
                    nv = h(v, c) if h is not None else _slow(v, c)
                loose = c.loose
                stay = c.stay
                append(nv)
                if nv is not v:
                    changed = True
    except (Bad, NotImplementedError) as e:
        raise located(e, f"[{len(out)}]", id(x), c) from None
    c.stay = stay
    return out if changed else None


def _list(x: list[Any], c: Ctx) -> Any:
    i = id(x)
    memo = c.memo
    hit = memo.get(i)
    if hit is not None:
        if hit is BUSY:
            raise Cycle(x)
        return hit
    memo[i] = BUSY
    out = _seq(x, c)
    res = x if out is None else out
    memo[i] = res
    return res


def _tuple(x: tuple[Any, ...], c: Ctx) -> Any:
    # A tuple cannot contain itself without a mutable container in between, so the
    # cycle guard of that container is enough; tuples are still memoised for aliasing.
    hit = c.memo.get(id(x))
    if hit is not None and hit is not BUSY:
        return hit
    out = _seq(x, c)
    res = x if out is None else tuple(out)
    c.memo[id(x)] = res
    return res


def _tuple_subclass(x: tuple[Any, ...], c: Ctx) -> Any:
    # namedtuples are rebuilt from their fields, other tuple subclasses from an iterable
    hit = c.memo.get(id(x))
    if hit is not None and hit is not BUSY:
        return hit
    out = _seq(x, c)
    if out is None:
        return unchanged(x, c)
    tp = type(x)
    if hasattr(tp, "_fields"):
        return rebuilt(x, c, f"{tp.__name__}(*fields)", lambda: tp(*out))

    def build() -> Any:
        res = tp(out)  # its own constructor (a refusal is reported), then its attributes
        copy_attributes(x, res)
        return res

    return rebuilt(x, c, f"{tp.__name__}(items)", build)


def _list_subclass(x: list[Any], c: Ctx) -> Any:
    hit = busy_or_done(x, c)
    if hit is not BUSY:
        return hit
    out = _seq(x, c)
    if out is None:
        return unchanged(x, c)

    def assign(res: list[Any]) -> None:
        res[:] = out

    return rebuilt(x, c, "copy.copy(obj)[:] = items", lambda: shallow_copy(x, assign))


def _mapping_items(x: Mapping[Any, Any], c: Ctx) -> dict[Any, Any] | None:
    """Move the values of a mapping; the changed ones, or None when nothing changed."""
    i = id(x)
    changed: dict[Any, Any] = {}
    get = _DISPATCH.get
    keep = c.kept()
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
    hit = busy_or_done(x, c)
    if hit is not BUSY:
        return hit
    changed = _mapping_items(x, c)
    if changed is None:
        return unchanged(x, c)

    def assign(res: dict[Any, Any]) -> None:
        for k, nv in changed.items():
            res[k] = nv

    def build() -> Any:
        try:
            return shallow_copy(x, assign)
        except TypeError:  # an immutable mapping: built from a dict, as the peers do
            res = type(x)({k: changed.get(k, v) for k, v in x.items()})
            with contextlib.suppress(Exception):  # its attributes, where it takes them
                copy_attributes(x, res)
            return res

    how = "copy.copy(obj)[key] = value, or type(obj)(dict)"
    return rebuilt(x, c, how, build)


def _mapping(x: Mapping[Any, Any], c: Ctx) -> Any:
    hit = busy_or_done(x, c)
    if hit is not BUSY:
        return hit
    changed = _mapping_items(x, c)
    if changed is None:
        return unchanged(x, c)
    items = {k: changed.get(k, v) for k, v in x.items()}
    return rebuilt(x, c, f"{type(x).__name__}(dict)", lambda: type(x)(items))  # type: ignore[call-arg]


def _set(x: set[Any] | frozenset[Any], c: Ctx) -> Any:
    hit = busy_or_done(x, c)
    if hit is not BUSY:
        return hit
    try:
        out = [move(v, c) for v in x]
    except (Bad, NotImplementedError) as e:
        raise located(e, "{...}", id(x), c) from None
    if all(map(operator.is_, out, x)):
        return unchanged(x, c)
    return rebuilt(x, c, f"{type(x).__name__}(items)", lambda: type(x)(out))


def _dataclass(x: Any, c: Ctx) -> Any:
    hit = busy_or_done(x, c)
    if hit is not BUSY:
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
        return unchanged(x, c)

    def assign(res: Any) -> None:
        # object.__setattr__ also works for frozen and slotted dataclasses
        for field, nv in updates:
            object.__setattr__(res, field, nv)

    how = "copy.copy(obj) and setting its fields"
    return rebuilt(x, c, how, lambda: shallow_copy(x, assign))


def _deque(x: collections.deque[Any], c: Ctx) -> Any:
    hit = busy_or_done(x, c)
    if hit is not BUSY:
        return hit
    out = _seq(x, c)
    if out is None:
        return unchanged(x, c)
    if type(x) is collections.deque:
        return rebuilt(x, c, "deque(items, maxlen)", lambda: collections.deque(out, x.maxlen))

    def build() -> Any:
        tp = type(x)
        res = tp.__new__(tp)
        collections.deque.__init__(res, out, x.maxlen)
        copy_attributes(x, res)
        return res

    return rebuilt(x, c, f"{type(x).__name__}.__new__ and deque.__init__", build)


_REGISTERED: dict[type, Registered] = {}


def register(tp: type, flatten: Flatten | None, unflatten: Unflatten | None) -> None:
    """Walk instances of ``tp`` (and subclasses) through ``flatten``/``unflatten``.

    Defaults: the instance attributes (``__dict__`` and ``__slots__``) in, a shallow
    copy with the moved attributes set out.
    """
    _REGISTERED[tp] = Registered(
        flatten or attributes,
        unflatten or set_attributes,
        move,
        check=flatten is not None,
        named=flatten is not None and unflatten is None,
    )
    _WARNED.discard(tp)
    _forget_cached_handlers()


_WARNED: set[type] = set()


def forget_warnings() -> None:
    """Warn again for every type (tests: each starts as a fresh process would)."""
    _WARNED.clear()
    for registered in _REGISTERED.values():
        registered.check = registered.flatten is not attributes
    _forget_cached_handlers()


def _unknown(x: Any, c: Ctx) -> Any:
    """An object of a type the walker does not know: left alone, and probed for tensors
    when the walk is done (:func:`finish`)."""
    if type(x) not in _WARNED:
        c.met_unknown(x)
    return x


def _handler_for(tp: type) -> Handler:
    from torch.utils.data import DataLoader

    if issubclass(tp, torch.nn.Parameter):
        return move_param
    if issubclass(tp, torch.Tensor):
        return move_tensor
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
        return reject_loader
    if issubclass(tp, (types.GeneratorType, types.AsyncGeneratorType)) or (
        issubclass(tp, Iterator) and not issubclass(tp, io.IOBase)
    ):
        return reject_iterator
    if issubclass(tp, collections.UserDict):
        return _dict_subclass  # transformers' BatchEncoding: walked, not moved in place
    if callable(getattr(tp, "to", None)):
        return move_duck
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
    return _unknown if has_attributes(tp) else _leaf


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

_DISPATCH: dict[type, Handler] = {
    torch.Tensor: move_tensor,
    torch.nn.Parameter: move_param,
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
    """What a walk does once it succeeded: warnings, deferred in-place moves, waits."""
    if c.unknown is not None:
        for tp in warn_left_behind(c.unknown, c.memo, _WARNED):
            _DISPATCH[tp] = _leaf  # warned once: from now on a plain leaf
    if c.pending is not None:
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
    except (Bad, NotImplementedError, RecursionError) as e:
        user_error(e, c, root)


def move_root(
    x: Any,
    device: torch.device,
    non_blocking: bool | None,
    root: str,
    staging: Staging | None = None,
) -> Any:
    """Move ``x`` (called ``root`` in error messages) to ``device``: one whole walk."""
    kind = device_kind(device)
    if staging is None:
        if type(x) is _Tensor:  # one plain tensor: no walk (forced async to the CPU waits)
            if x.device == device:
                return x
            nb = not kind[0] if non_blocking is None else non_blocking
            if not (nb and kind[1]) and not x.is_meta:
                return x.to(device, non_blocking=True) if nb else x.to(device)
        elif kind[1] and all_on_cpu(x):
            return x
    c = Ctx(device, non_blocking, staging, kind)
    try:  # traverse(), inline: this runs on every call
        h = _get(type(x))
        out = h(x, c) if h is not None else _slow(x, c)
    except (Bad, NotImplementedError, RecursionError) as e:
        user_error(e, c, root)
    if c.pending is not None or c.unknown is not None or c.sync:
        finish(c)
    return out
