"""on_device: move anything a training loop holds (tensors, modules, optimizers, nested
containers) onto a device, as a call or as a decorator."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar, cast, overload

import torch
from typing_extensions import ParamSpec

from .._check import check_callable, check_optional, check_type
from .._tree import Ctx, finish, move_root, traverse
from . import _handlers  # noqa: F401  (registers the module and optimizer handlers)
from .resolve import DeviceLike, resolve_cached, resolve_for

__all__ = ["OnDeviceDecorator", "on_device"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
T1 = TypeVar("T1")
T2 = TypeVar("T2")
T3 = TypeVar("T3")


def _check_non_blocking(non_blocking: object) -> None:
    check_optional(
        check_type,
        "on_device",
        "non_blocking",
        non_blocking,
        types=bool,
        expected="None (async host-to-device copies, synchronous to the CPU), True or False",
        fix="Leave it out unless you need to force the copy mode.",
    )


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
                resolve_for("on_device", device)  # raises DeviceError with a suggestion
                raise  # pragma: no cover - resolve_device always raises here
        elif isinstance(device, bool) or not isinstance(device, (int, torch.device, type(None))):
            resolve_for("on_device", device)  # raises TypeError naming the accepted types
        elif isinstance(device, int) and device < 0:
            resolve_for("on_device", device)  # raises DeviceError: a negative index is never valid
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
        check_callable(
            "on_device",
            "func",
            func,
            expected="a function to decorate",
            fix="Write `@on_device(device=...)` above a `def`, or call "
            "`on_device(obj, device=...)` to move data.",
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
            c = Ctx(resolve_cached(spec), non_blocking)
            new_args = traverse(args[skip:], c, f"{name}() args") if len(args) > skip else ()
            new_kwargs = traverse(kwargs, c, f"{name}() kwargs") if kwargs else kwargs
            finish(c)
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
    >>> model, target = on_device(
    ...     torch.nn.Linear(3, 1), torch.ones(2), device="meta"
    ... )
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
            ``cudakit.data.prefetch``), a container that cannot be rebuilt (a registered
            ``unflatten`` that raises or returns ``None``), or a bad ``non_blocking``.
        ValueError: a module with parameters on the ``meta`` device (use
            ``module.to_empty``), or a reference cycle (the message names where).
        DeviceError: the device does not exist here or is misspelt.

    .. versionadded:: 0.1
    """
    if non_blocking is not None and non_blocking is not True and non_blocking is not False:
        _check_non_blocking(non_blocking)  # type: ignore[unreachable]
    if len(objs) == 1:
        obj = objs[0]
        if type(obj) not in _DATA:  # a batch goes straight to the walk
            if isinstance(obj, (types.FunctionType, types.MethodType, staticmethod, classmethod)):
                return OnDeviceDecorator(device, non_blocking)(obj)
            if device is None and isinstance(obj, (str, torch.device)):
                return OnDeviceDecorator(obj, non_blocking)
        return move_root(obj, resolve_cached(device), non_blocking, "obj")
    if not objs:
        return OnDeviceDecorator(device, non_blocking)
    return move_root(objs, resolve_cached(device), non_blocking, "objs")


#: What a batch usually is: never a function to decorate or a device to decorate with.
_DATA = frozenset({dict, list, tuple, torch.Tensor})
