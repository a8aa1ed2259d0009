"""Device placement.

:func:`resolve_device` turns what the user wrote into a ``torch.device``;
:func:`on_device` moves anything a training loop holds (tensors, modules,
optimizers, nested containers) onto it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import inspect
import io
import operator
import re
import types
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn, TypeVar, cast, overload

import torch
from typing_extensions import ParamSpec

from ._accel import current_cuda_index
from .exceptions import DeviceError

__all__ = ["DeviceLike", "OnDeviceDecorator", "on_device", "resolve_device"]

#: Everything cudakit accepts wherever it takes ``device=``.
DeviceLike = torch.device | str | int | None

_KNOWN_TYPES = ("cpu", "cuda", "mps", "meta")
_GLUED_INDEX = re.compile(r"^(cuda|cpu|mps|meta)(\d+)$")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def _existing_cuda() -> str:
    n = torch.cuda.device_count()
    if n == 0:
        return "no CUDA devices"
    return ", ".join(f"cuda:{i}" for i in range(n))


def _suggest(spec: str) -> str:
    low = spec.strip().lower()
    m = _GLUED_INDEX.match(low)
    if m:
        return f"{m.group(1)}:{m.group(2)}"
    if low in ("gpu", "nvidia", "cuda()", "gpu:0") or low.startswith("gpu"):
        idx = low[3:].lstrip(":")
        return f"cuda:{idx}" if idx.isdigit() else "cuda"
    if low in _KNOWN_TYPES or low == "auto":
        return low
    close = difflib.get_close_matches(low.split(":")[0], [*_KNOWN_TYPES, "auto"], n=1)
    return close[0] if close else "auto"


def _check_cuda_index(index: int, spec: object) -> torch.device:
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device={spec!r} asks for CUDA, but CUDA is not available on this machine "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}). "
            'Use device="auto" to fall back to the best available device, or "cpu".'
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"device={spec!r} asks for CUDA device {index}, but this machine has {count} "
            f"visible CUDA device(s): {_existing_cuda()}. Pick one of those "
            "(CUDA_VISIBLE_DEVICES may be hiding the others)."
        )
    return torch.device("cuda", index)


def resolve_device(spec: DeviceLike = None) -> torch.device:
    """Turn a device spec into a concrete ``torch.device``, or explain why it cannot.

    ``None`` and ``"auto"`` pick the current CUDA device, else MPS, else the CPU
    (a quiet fallback: you asked for the best there is). Everything explicit is
    honoured exactly or raises :class:`~cudakit.exceptions.DeviceError`.

    >>> resolve_device("cpu")
    device(type='cpu')
    >>> resolve_device(torch.device("meta"))
    device(type='meta')
    >>> resolve_device("gpu")
    Traceback (most recent call last):
    ...
    cudakit.exceptions.DeviceError: unknown device 'gpu'; did you mean 'cuda'? ...

    Args:
        spec: ``None``/``"auto"``; ``"cuda"`` (the current CUDA device) or
            ``"cuda:N"``; an ``int`` N (CUDA device N); ``"cpu"``, ``"mps"``,
            ``"meta"``; or a ``torch.device``, which is checked and passed through.

    Returns:
        A ``torch.device``; CUDA devices always carry an index.

    Raises:
        DeviceError: the device does not exist here, or the spec is misspelt.
        TypeError: the spec is not a string, int, ``torch.device`` or ``None``.

    .. versionadded:: 0.1
    """
    if spec is None or (isinstance(spec, str) and spec == "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda", current_cuda_index())
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if isinstance(spec, bool) or not isinstance(spec, (str, int, torch.device)):
        raise TypeError(
            "device must be a torch.device, a string such as 'cuda:0', an int CUDA index or "
            f"None, got {type(spec).__name__} {spec!r}. Pass device='auto' to let cudakit choose."
        )
    if isinstance(spec, int):
        if spec < 0:
            raise DeviceError(
                f"device={spec} is a negative CUDA index; CUDA indices start at 0. "
                f"Existing devices: {_existing_cuda()}."
            )
        return _check_cuda_index(spec, spec)
    if isinstance(spec, str):
        try:
            dev = torch.device(spec)
        except (RuntimeError, ValueError):
            raise DeviceError(
                f"unknown device {spec!r}; did you mean {_suggest(spec)!r}? "
                "Valid specs: 'auto', 'cpu', 'cuda', 'cuda:N', 'mps', 'meta', an int N, "
                "or a torch.device."
            ) from None
    else:
        dev = spec
    if dev.type == "cuda":
        return _check_cuda_index(current_cuda_index() if dev.index is None else dev.index, spec)
    if dev.type == "mps" and not _mps_available():
        raise DeviceError(
            f"device={spec!r} asks for Apple MPS, which is not available on this machine. "
            'Use device="auto" or "cpu".'
        )
    return dev


# --------------------------------------------------------------------------------------
# on_device: recursive moves
# --------------------------------------------------------------------------------------

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
T1 = TypeVar("T1")
T2 = TypeVar("T2")
T3 = TypeVar("T3")

_Handler = Callable[[Any, "_Ctx"], Any]
_Tensor = torch.Tensor
_BUSY = object()  # memo marker: this container is being traversed right now (cycle guard)
_MAX_CACHED_TYPES = 1024
_SYNC_TARGETS = ("cpu", "meta")  # copies there are synchronous unless forced


class _Ctx:
    """State of one ``on_device`` call: target, copy mode, memo, deferred in-place moves."""

    __slots__ = ("device", "keep", "memo", "nb", "pending", "sync", "track")

    def __init__(self, device: torch.device, non_blocking: bool | None) -> None:
        self.device = device
        kind = _KINDS.get(device)
        if kind is None:
            kind = _KINDS[device] = (device.type in _SYNC_TARGETS, device.type == "cpu")
        nb = not kind[0] if non_blocking is None else non_blocking
        self.nb = nb
        # id(obj) -> result. Ids stay unique because the input keeps its objects alive;
        # values a custom mapping makes on the fly are kept alive in `keep`.
        self.memo: dict[int, Any] = {}
        self.keep: list[Any] = []
        # In-place moves (modules, optimizer state) run only after the whole traversal
        # succeeded, so an error anywhere leaves everything the user owns untouched.
        self.pending: list[Callable[[], None]] = []
        # A forced non_blocking copy to the CPU must be waited for before we return.
        self.track = nb and kind[1]
        self.sync: set[torch.device] = set()


# device -> (copies there are synchronous by default, device is the CPU)
_KINDS: dict[torch.device, tuple[bool, bool]] = {}


class _Bad(Exception):
    """Internal: bad input found during traversal; collects the path while unwinding."""

    def __init__(self, exc_type: type[Exception], message: str) -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.message = message
        self.path: list[str] = []  # innermost first
        self.cause: BaseException | None = None  # chained to the user-facing error

    def add(self, step: str, container_id: int) -> None:
        self.path.append(step)

    def where(self, root: str) -> str:
        return root + "".join(reversed(self.path))

    def render(self, root: str) -> str:
        return self.message.replace("{where}", self.where(root))


def _meta_copy_error(err: Exception, c: _Ctx) -> _Bad:
    """The user-facing error for copying a meta tensor; any other error is re-raised."""
    if not isinstance(err, NotImplementedError) or "meta tensor" not in str(err):
        raise err
    bad = _Bad(
        ValueError,
        f"on_device() cannot copy the tensor at {{where}} from the meta device to {c.device}: "
        "meta tensors have a shape but no data. Create it on the target device instead "
        "(e.g. `torch.empty_like(t, device=...)`), or for a module use "
        "`module.to_empty(device=...)` and then initialise or load its weights.",
    )
    bad.cause = err
    return bad


def _located(err: Exception, step: str, container_id: int, c: _Ctx) -> _Bad:
    """``err``, raised inside a container, as a :class:`_Bad` with ``step`` added to its path."""
    bad = err if isinstance(err, _Bad) else _meta_copy_error(err, c)
    bad.add(step, container_id)
    return bad


class _Cycle(_Bad):
    """Internal: a container was reached again while it was still being traversed."""

    def __init__(self, container: object) -> None:
        super().__init__(ValueError, "")
        self.container_id = id(container)
        self.kind = type(container).__name__
        self.depth: int | None = None  # len(path) once the repeated container added its step

    def add(self, step: str, container_id: int) -> None:
        self.path.append(step)
        if self.depth is None and container_id == self.container_id:
            self.depth = len(self.path)

    def render(self, root: str) -> str:
        steps = list(reversed(self.path))
        head = root + "".join(steps[: len(steps) - (self.depth or 0)])
        return (
            f"on_device() found a reference cycle: {self.where(root)} refers back to {head} "
            f"(a {self.kind} that contains itself), which cannot be copied. Break the cycle "
            "(e.g. store an index or key instead of the container), or move the tensors "
            "inside it yourself."
        )


def _busy_or_done(x: object, c: _Ctx) -> Any:
    hit = c.memo.get(id(x))
    if hit is None:
        c.memo[id(x)] = _BUSY
        return _BUSY
    if hit is _BUSY:
        raise _Cycle(x)
    return hit


def _move(x: Any, c: _Ctx) -> Any:
    h = _DISPATCH.get(type(x))
    return h(x, c) if h is not None else _slow(x, c)


def _leaf(x: Any, c: _Ctx) -> Any:
    return x


def _copy(t: torch.Tensor, c: _Ctx) -> torch.Tensor:
    """Copy one tensor that is not on the target yet (callers checked memo and device)."""
    if c.track:
        c.sync.add(t.device)
    # Passing non_blocking only when it is True keeps the common call cheap.
    new = t.to(c.device, non_blocking=True) if c.nb else t.to(c.device)
    c.memo[id(t)] = new
    return new


def _tensor(t: torch.Tensor, c: _Ctx) -> torch.Tensor:
    if t.device == c.device:
        return t
    hit = c.memo.get(id(t))
    return _copy(t, c) if hit is None else cast(torch.Tensor, hit)


def _param(p: torch.nn.Parameter, c: _Ctx) -> torch.Tensor:
    if p.device == c.device:
        return p
    hit = c.memo.get(id(p))
    if hit is not None:
        return cast(torch.Tensor, hit)
    if c.track:
        c.sync.add(p.device)
    # Tensor.to on a Parameter returns a plain non-leaf tensor; rebuild the Parameter
    # (as Module.to does), keeping requires_grad and moving an accumulated .grad along.
    new = torch.nn.Parameter(p.detach().to(c.device, non_blocking=c.nb), p.requires_grad)
    if p.grad is not None:
        new.grad = p.grad.to(c.device, non_blocking=c.nb)
    c.memo[id(p)] = new
    return new


def _dict(x: dict[Any, Any], c: _Ctx) -> Any:
    # The hot path: plain dicts and lists of plain tensors are handled inline, with a
    # single dict lookup on the exact type for everything else (no isinstance chains).
    i = id(x)
    memo = c.memo
    hit = memo.get(i)
    if hit is not None:
        if hit is _BUSY:
            raise _Cycle(x)
        return hit
    memo[i] = _BUSY
    out = {}
    changed = False
    get = _DISPATCH.get
    dev, nb, track = c.device, c.nb, c.track
    stay = True
    try:
        for k, v in x.items():
            tp = type(v)
            if tp is _Tensor:
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
    except (_Bad, NotImplementedError) as e:
        raise _located(e, f"[{k!r}]", i, c) from None
    res = out if changed else x
    memo[i] = res
    return res


def _seq(x: list[Any] | tuple[Any, ...], c: _Ctx) -> list[Any] | None:
    """Move the items of a list or tuple; None when no item changed."""
    out: list[Any] = []
    append = out.append
    get = _DISPATCH.get
    memo = c.memo
    dev, nb, track = c.device, c.nb, c.track
    stay = True
    changed = False
    try:
        for v in x:
            tp = type(v)
            if tp is _Tensor:
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
    except (_Bad, NotImplementedError) as e:
        raise _located(e, f"[{len(out)}]", id(x), c) from None
    return out if changed else None


def _list(x: list[Any], c: _Ctx) -> Any:
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


def _tuple(x: tuple[Any, ...], c: _Ctx) -> Any:
    # A tuple cannot contain itself without a mutable container in between, so the
    # cycle guard of that container is enough; tuples are still memoised for aliasing.
    hit = c.memo.get(id(x))
    if hit is not None and hit is not _BUSY:
        return hit
    out = _seq(x, c)
    res = x if out is None else tuple(out)
    c.memo[id(x)] = res
    return res


def _rebuild_failed(x: object, how: str, err: Exception) -> _Bad:
    name = type(x).__name__
    return _Bad(
        TypeError,
        f"on_device() moved the tensors inside the {name} at {{where}} but cannot rebuild a "
        f"{name} from them: {how} raised {type(err).__name__}: {err}. Give {name} a "
        "`.to(device, non_blocking=False)` method that returns the moved object, or pass a "
        "plain dict/list/tuple instead.",
    )


def _rebuilt(x: object, c: _Ctx, how: str, build: Callable[[], Any]) -> Any:
    """The moved copy of container ``x`` that ``build()`` makes, memoised.

    A failure becomes a ``TypeError`` that names the container, where it is and ``how``.
    """
    try:
        res = build()
    except Exception as err:
        raise _rebuild_failed(x, how, err) from None
    c.memo[id(x)] = res
    return res


def _unchanged(x: object, c: _Ctx) -> Any:
    c.memo[id(x)] = x
    return x


def _tuple_subclass(x: tuple[Any, ...], c: _Ctx) -> Any:
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
    return _rebuilt(x, c, f"{tp.__name__}(items)", lambda: tp(out))


def _shallow_copy(x: Any, assign: Callable[[Any], None]) -> Any:
    # copy.copy keeps instance attributes (and a defaultdict's factory) and does not run
    # __init__ again; `assign` writes the moved items into the copy.
    res = copy.copy(x)
    assign(res)
    return res


def _list_subclass(x: list[Any], c: _Ctx) -> Any:
    hit = _busy_or_done(x, c)
    if hit is not _BUSY:
        return hit
    out = _seq(x, c)
    if out is None:
        return _unchanged(x, c)

    def assign(res: list[Any]) -> None:
        res[:] = out

    return _rebuilt(x, c, "copy.copy(obj)[:] = items", lambda: _shallow_copy(x, assign))


def _mapping_items(x: Mapping[Any, Any], c: _Ctx) -> dict[Any, Any] | None:
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
    except (_Bad, NotImplementedError) as e:
        raise _located(e, f"[{k!r}]", i, c) from None
    return changed or None


def _dict_subclass(x: dict[Any, Any], c: _Ctx) -> Any:
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


def _mapping(x: Mapping[Any, Any], c: _Ctx) -> Any:
    hit = _busy_or_done(x, c)
    if hit is not _BUSY:
        return hit
    changed = _mapping_items(x, c)
    if changed is None:
        return _unchanged(x, c)
    items = {k: changed.get(k, v) for k, v in x.items()}
    return _rebuilt(x, c, f"{type(x).__name__}(dict)", lambda: type(x)(items))  # type: ignore[call-arg]


def _set(x: set[Any] | frozenset[Any], c: _Ctx) -> Any:
    hit = _busy_or_done(x, c)
    if hit is not _BUSY:
        return hit
    try:
        out = [_move(v, c) for v in x]
    except (_Bad, NotImplementedError) as e:
        raise _located(e, "{...}", id(x), c) from None
    if all(map(operator.is_, out, x)):
        return _unchanged(x, c)
    return _rebuilt(x, c, f"{type(x).__name__}(items)", lambda: type(x)(out))


def _dataclass(x: Any, c: _Ctx) -> Any:
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
            nv = _move(v, c)
            if nv is not v:
                updates.append((name, nv))
    except (_Bad, NotImplementedError) as e:
        raise _located(e, f".{name}", id(x), c) from None
    if not updates:
        return _unchanged(x, c)

    def assign(res: Any) -> None:
        # object.__setattr__ also works for frozen and slotted dataclasses
        for field, nv in updates:
            object.__setattr__(res, field, nv)

    how = "copy.copy(obj) and setting its fields"
    return _rebuilt(x, c, how, lambda: _shallow_copy(x, assign))


def _same_place(t: torch.Tensor, device: torch.device) -> bool:
    d = t.device
    index: int | None = device.index  # typed as int by torch, but None for "mps", "cpu"
    return d == device or (index is None and d.type == device.type)


_IN_PLACE: dict[tuple[torch.device, torch.device], bool] = {}


def _moved_in_place(p: torch.Tensor, device: torch.device) -> bool:
    """Whether ``Module.to(device)`` keeps the Parameter object ``p`` (``Module._apply``'s rule).

    It does with ``torch.__future__``'s swap flag, and when the old and new tensors have
    compatible types (CPU and CUDA: ``param.data`` is swapped); not for ``meta`` or when
    the overwrite flag is set, where the module gets a new Parameter.
    """
    if torch.__future__.get_swap_module_params_on_conversion():
        return True
    if type(p) is not torch.nn.Parameter or (
        torch.__future__.get_overwrite_module_params_on_conversion()
    ):
        return False
    key = (p.device, device)
    kept = _IN_PLACE.get(key)
    if kept is None:
        probe = torch.empty(0, dtype=p.dtype, device=device)
        kept = _IN_PLACE[key] = bool(torch._has_compatible_shallow_copy_type(p, probe))
    return kept


def _module(m: torch.nn.Module, c: _Ctx) -> Any:
    if id(m) in c.memo:
        return m
    c.memo[id(m)] = m
    device = c.device
    needs_move = False
    sources: set[torch.device] = set()
    for kind, named in (("parameter", m.named_parameters()), ("buffer", m.named_buffers())):
        for name, t in named:
            if t.is_meta and device.type != "meta":
                raise _Bad(
                    ValueError,
                    f"on_device() cannot move the {type(m).__name__} at {{where}} to "
                    f"{device}: its {kind} {name!r} is on the meta device and holds no data "
                    f"to copy. Allocate the module with `module.to_empty(device={str(device)!r})`"
                    ", then initialise or load its weights (e.g. "
                    "`module.load_state_dict(state_dict, assign=True)`).",
                )
            if not _same_place(t, device):
                needs_move = True
                sources.add(t.device)
                if kind == "parameter" and _moved_in_place(t, device):
                    # Module.to keeps this Parameter object: the same tensor found
                    # elsewhere in the input after the module is shared, not copied.
                    c.memo.setdefault(id(t), t)
    if needs_move:
        nb = c.nb
        if c.track:
            c.sync.update(sources)

        def move_module() -> None:
            m.to(device, non_blocking=nb)

        c.pending.append(move_module)
    return m


def _optimizer(opt: torch.optim.Optimizer, c: _Ctx) -> Any:
    if id(opt) in c.memo:
        return opt
    c.memo[id(opt)] = opt
    # torch keeps a scalar `step` on the CPU unless the param group is capturable or fused,
    # in which case it must live with the parameters (Optimizer.load_state_dict's policy).
    on_device_step: set[int] = set()
    for group in opt.param_groups:
        if group.get("capturable", False) or group.get("fused", False):
            on_device_step.update(id(p) for p in group["params"])
    updates: list[tuple[dict[Any, Any], Any, Any]] = []
    for p, state in opt.state.items():
        if not isinstance(state, dict):
            continue
        for k, v in state.items():
            if k == "step" and isinstance(v, torch.Tensor) and id(p) not in on_device_step:
                continue
            try:
                nv = _move(v, c)
            except (_Bad, NotImplementedError) as e:
                raise _located(e, f".state[<param {tuple(p.shape)}>][{k!r}]", id(opt), c) from None
            if nv is not v:
                updates.append((state, k, nv))
    if updates:

        def move_state() -> None:
            for state, k, nv in updates:
                state[k] = nv

        c.pending.append(move_state)
    return opt


def _duck(x: Any, c: _Ctx) -> Any:
    hit = c.memo.get(id(x))
    if hit is not None and hit is not _BUSY:
        return hit
    # When the caller forced non_blocking towards the CPU we cannot know which streams an
    # arbitrary .to() used, so such objects are copied synchronously (always safe to read).
    nb = c.nb and not c.track
    try:
        res = x.to(c.device, non_blocking=nb)
    except TypeError as err:
        # Only a .to() that does not take non_blocking is called again without it; any
        # other TypeError is the object's own and must not be hidden by a second call.
        if "non_blocking" not in str(err):
            raise
        res = x.to(c.device)
    c.memo[id(x)] = res
    return res


_PREFETCH_HINT = (
    "Move each batch inside the loop (`for batch in loader: batch = on_device(batch)`), or "
    "wrap the loader with `cudakit.data.prefetch(loader)`, which yields batches already on "
    "the device and overlaps the copies with compute."
)


def _reject_loader(x: Any, c: _Ctx) -> NoReturn:
    raise _Bad(
        TypeError,
        f"on_device() cannot move a {type(x).__name__} (found at {{where}}): a loader makes "
        f"batches, it does not hold them. {_PREFETCH_HINT}",
    )


def _reject_iterator(x: Any, c: _Ctx) -> NoReturn:
    kind = (
        "a generator" if isinstance(x, types.GeneratorType) else f"an iterator ({type(x).__name__})"
    )
    raise _Bad(
        TypeError,
        f"on_device() cannot move {kind} (found at {{where}}): its items are produced "
        f"lazily and moving them would consume it. {_PREFETCH_HINT}",
    )


def _handler_for(tp: type) -> _Handler:
    from torch.utils.data import DataLoader

    if issubclass(tp, torch.nn.Parameter):
        return _param
    if issubclass(tp, torch.Tensor):
        return _tensor
    if issubclass(tp, torch.nn.Module):
        return _module
    if issubclass(tp, torch.optim.Optimizer):
        return _optimizer
    if issubclass(tp, DataLoader):
        return _reject_loader
    if issubclass(tp, (types.GeneratorType, types.AsyncGeneratorType)) or (
        issubclass(tp, Iterator) and not issubclass(tp, io.IOBase)
    ):
        return _reject_iterator
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
    if dataclasses.is_dataclass(tp):
        return _dataclass
    return _leaf


def _slow(x: Any, c: _Ctx) -> Any:
    tp = type(x)
    h = _handler_for(tp)
    if len(_DISPATCH) < _MAX_CACHED_TYPES:
        _DISPATCH[tp] = h
    return h(x, c)


_DISPATCH: dict[type, _Handler] = {
    torch.Tensor: _tensor,
    torch.nn.Parameter: _param,
    dict: _dict,
    list: _list,
    tuple: _tuple,
    set: _set,
    frozenset: _set,
    OrderedDict: _dict_subclass,
    defaultdict: _dict_subclass,
    **dict.fromkeys(
        (
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
            torch.dtype,
            torch.device,
            torch.Size,
            torch.layout,
            torch.memory_format,
        ),
        _leaf,
    ),
}


def _finish(c: _Ctx) -> None:
    for action in c.pending:
        action()
    for dev in c.sync:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elif dev.type == "mps":
            torch.mps.synchronize()


def _check_non_blocking(non_blocking: object) -> None:
    if non_blocking is not None and not isinstance(non_blocking, bool):
        raise TypeError(
            "on_device(non_blocking=...) expects None (async host-to-device copies, "
            f"synchronous to the CPU), True or False, got {type(non_blocking).__name__} "
            f"{non_blocking!r}."
        )


_RESOLVED: dict[tuple[type, object], torch.device] = {}


def _resolve_cached(spec: DeviceLike) -> torch.device:
    """resolve_device, memoised for explicit specs whose answer cannot change.

    ``None``/``"auto"`` and an index-less ``"cuda"`` follow the current device, so
    they are resolved on every call; ``"cpu"``, ``"meta"``, ``"cuda:1"``, ``1`` or a
    ``torch.device`` with an index always mean the same device in a process.
    """
    key = (type(spec), spec)
    try:
        return _RESOLVED[key]
    except (KeyError, TypeError):
        pass
    dev = resolve_device(spec)
    stable = spec is not None and spec != "auto"
    if dev.type == "cuda":
        stable = stable and (
            isinstance(spec, int) or (isinstance(spec, (str, torch.device)) and ":" in str(spec))
        )
    if stable and len(_RESOLVED) < 64:
        _RESOLVED[key] = dev
    return dev


def _traverse(x: Any, c: _Ctx, root: str) -> Any:
    """Move ``x`` within ``c``, turning internal errors into the user-facing ones."""
    try:
        return _move(x, c)
    except (_Bad, NotImplementedError) as e:
        bad = e if isinstance(e, _Bad) else _meta_copy_error(e, c)
        raise bad.exc_type(bad.render(root)) from bad.cause


def _move_root(x: Any, device: torch.device, non_blocking: bool | None, root: str) -> Any:
    c = _Ctx(device, non_blocking)
    out = _traverse(x, c, root)
    _finish(c)
    return out


class OnDeviceDecorator:
    """A decorator, made by :func:`on_device`, that moves a function's arguments.

    Every positional and keyword argument is moved with :func:`on_device` before the
    call; a first parameter named ``self`` or ``cls`` is left alone, so methods work.
    The device is resolved at each call, so ``device=None`` follows the current device.

    >>> import torch
    >>> from cudakit.device import on_device
    >>> @on_device("meta")
    ... def where(x, *, y):
    ...     return x.device, y["t"].device
    >>> where(torch.ones(2), y={"t": torch.zeros(1)})
    (device(type='meta'), device(type='meta'))

    ``@on_device`` may sit above or below ``@staticmethod`` and ``@classmethod``; the
    class of a classmethod is never moved.

    Args:
        device: Target, as for :func:`resolve_device`. A misspelt name, a wrong type or
            a negative index fails at decoration; whether the device exists here is
            checked at each call, so decorated code imports on any machine.
        non_blocking: As for :func:`on_device`.

    Raises:
        DeviceError: ``device`` is misspelt or a negative index.
        TypeError: ``device`` or ``non_blocking`` has the wrong type.

    .. versionadded:: 0.1
    """

    __slots__ = ("device", "non_blocking")

    def __init__(self, device: DeviceLike = None, non_blocking: bool | None = None) -> None:
        _check_non_blocking(non_blocking)
        if isinstance(device, str) and device != "auto":
            # A misspelt device fails at decoration time; whether the device exists is
            # checked at call time, so decorated code still imports on a CPU-only box.
            try:
                torch.device(device)
            except (RuntimeError, ValueError):
                resolve_device(device)  # raises DeviceError with a suggestion
                raise  # pragma: no cover - resolve_device always raises here
        elif isinstance(device, bool) or not isinstance(device, (int, torch.device, type(None))):
            resolve_device(device)  # raises TypeError naming the accepted types
        elif isinstance(device, int) and device < 0:
            resolve_device(device)  # raises DeviceError: a negative index is never valid
        self.device = device
        self.non_blocking = non_blocking

    def __repr__(self) -> str:
        return f"on_device(device={self.device!r}, non_blocking={self.non_blocking!r})"

    @overload
    def __call__(self, func: staticmethod[P, R]) -> staticmethod[P, R]: ...
    @overload
    def __call__(self, func: classmethod[T, P, R]) -> classmethod[T, P, R]: ...
    @overload
    def __call__(self, func: Callable[P, R]) -> Callable[P, R]: ...
    def __call__(self, func: Any) -> Any:
        """Wrap ``func`` so that its arguments are moved before every call.

        ``staticmethod`` and ``classmethod`` objects are unwrapped, decorated and
        wrapped again, so ``@on_device`` may sit above or below them.

        Raises:
            TypeError: ``func`` is not callable.
        """
        if isinstance(func, staticmethod):
            return staticmethod(self._wrap(func.__func__, skip=0))
        if isinstance(func, classmethod):
            return classmethod(self._wrap(func.__func__, skip=1))
        if not callable(func):
            raise TypeError(
                f"on_device(...) used as a decorator expects a function, got "
                f"{type(func).__name__} {func!r}. Write `@on_device(device=...)` above a `def`, "
                "or call `on_device(obj, device=...)` to move data."
            )
        try:
            params = list(inspect.signature(func).parameters)
        except (TypeError, ValueError):
            params = []
        return self._wrap(func, skip=1 if params and params[0] in ("self", "cls") else 0)

    def _wrap(self, func: Callable[P, R], *, skip: int) -> Callable[P, R]:
        spec, non_blocking = self.device, self.non_blocking
        name = getattr(func, "__qualname__", type(func).__name__)

        def move_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
            c = _Ctx(_resolve_cached(spec), non_blocking)
            new_args = _traverse(args[skip:], c, f"{name}() args") if len(args) > skip else ()
            new_kwargs = _traverse(kwargs, c, f"{name}() kwargs") if kwargs else kwargs
            _finish(c)
            return (*args[:skip], *new_args), new_kwargs

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                a, k = move_args(args, kwargs)
                return await func(*a, **k)

            return cast(Callable[P, R], async_wrapper)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            a, k = move_args(args, kwargs)
            return func(*a, **k)

        return wrapper


@overload
def on_device(device: str | torch.device, /) -> OnDeviceDecorator: ...
@overload
def on_device(
    *, device: DeviceLike = None, non_blocking: bool | None = None
) -> OnDeviceDecorator: ...
@overload
def on_device(obj: T, /, *, device: DeviceLike = None, non_blocking: bool | None = None) -> T: ...
@overload
def on_device(
    obj: T1, obj2: T2, /, *, device: DeviceLike = None, non_blocking: bool | None = None
) -> tuple[T1, T2]: ...
@overload
def on_device(
    obj: T1,
    obj2: T2,
    obj3: T3,
    /,
    *,
    device: DeviceLike = None,
    non_blocking: bool | None = None,
) -> tuple[T1, T2, T3]: ...
@overload
def on_device(
    *objs: Any, device: DeviceLike = None, non_blocking: bool | None = None
) -> tuple[Any, ...]: ...
def on_device(*objs: Any, device: DeviceLike = None, non_blocking: bool | None = None) -> Any:
    """Move tensors, modules, optimizers and nested containers to a device, recursively.

    >>> import torch
    >>> from cudakit.device import on_device
    >>> batch = {"x": torch.ones(2, 3), "y": [torch.zeros(2)], "ids": ["a", "b"]}
    >>> moved = on_device(batch, device="meta")
    >>> moved["x"].device, moved["y"][0].device, moved["ids"] is batch["ids"]
    (device(type='meta'), device(type='meta'), True)
    >>> on_device(batch, device="cpu") is batch  # nothing to move: the same object
    True
    >>> model, target = on_device(torch.nn.Linear(3, 1), torch.ones(2), device="meta")
    >>> model.weight.device, target.device
    (device(type='meta'), device(type='meta'))

    What moves: tensors (an ``nn.Parameter`` stays a Parameter), ``nn.Module`` and
    ``torch.optim.Optimizer`` (moved in place, the same object returned), ``dict``,
    ``OrderedDict``, ``defaultdict`` and other mappings, ``list``, ``tuple``,
    namedtuples, ``set``/``frozenset``, dataclasses (frozen too) and any object with a
    ``.to()`` method. Other leaves (numbers, strings, ``None``, numpy arrays) come back
    as the same objects; a container in which nothing moved comes back as itself. A
    tensor that appears several times is moved once and shared in the result.

    Forms: ``on_device(obj)`` returns the moved object, ``on_device(a, b, c)`` a tuple;
    ``@on_device``, ``@on_device("cuda")`` and ``@on_device(device=...)`` decorate a
    function so that its arguments are moved before each call (see
    :class:`OnDeviceDecorator`).

    Args:
        *objs: What to move; one object, several, or a single function to decorate.
        device: Target, as for :func:`resolve_device`; ``None`` picks the best device.
        non_blocking: ``None`` (default) copies asynchronously towards an accelerator and
            synchronously to the CPU. ``True``/``False`` force it; data returned on the CPU
            is safe to read in every mode (forced async copies are waited for).

    Returns:
        The moved object, a tuple of them, or a decorator.

    Raises:
        TypeError: a generator, iterator or ``DataLoader`` (use
            ``cudakit.data.prefetch``), a container that cannot be rebuilt, or a bad
            ``non_blocking``.
        ValueError: a module with parameters on the ``meta`` device (use
            ``module.to_empty``), or a reference cycle (the message names where).
        DeviceError: the device does not exist here or is misspelt.

    .. versionadded:: 0.1
    """
    if non_blocking is not None and non_blocking is not True and non_blocking is not False:
        _check_non_blocking(non_blocking)  # type: ignore[unreachable]
    if not objs:
        return OnDeviceDecorator(device, non_blocking)
    if len(objs) == 1:
        obj = objs[0]
        if isinstance(obj, (types.FunctionType, types.MethodType, staticmethod, classmethod)):
            return OnDeviceDecorator(device, non_blocking)(obj)
        if device is None and isinstance(obj, (str, torch.device)):
            return OnDeviceDecorator(obj, non_blocking)
        return _move_root(obj, _resolve_cached(device), non_blocking, "obj")
    return _move_root(objs, _resolve_cached(device), non_blocking, "objs")
