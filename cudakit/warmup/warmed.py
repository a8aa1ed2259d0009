"""Warm up a step function on its first call: :func:`warmed`."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar, overload

import torch
from torch import nn
from typing_extensions import ParamSpec

from .._check import check_callable, check_extra, check_int
from .._contextlib import reject_deferred_body
from ._args import check_model, check_optimizer
from .preserve import preserve_state

P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["WarmedDecorator", "warmed"]


class WarmedDecorator(Protocol):
    """What ``warmed(model=...)`` returns when no function is given: the decorator.

    Calling it on a step function gives the warmed function, with the same signature,
    as :func:`warmed` would (``@warmed(model=model, optimizer=opt)`` above a ``def``).
    A type for annotations; at run time the decorator is a plain function.

    .. versionadded:: 0.1
    """

    def __call__(self, fn: Callable[P, R], /) -> Callable[P, R]:
        """Wrap ``fn``: its first call is preceded by warm-up calls that leave no trace."""


@overload
def warmed(
    fn: Callable[P, R],
    /,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = ...,
    extra: Iterable[Any] = ...,
    steps: int = ...,
) -> Callable[P, R]: ...
@overload
def warmed(
    fn: None = None,
    /,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = ...,
    extra: Iterable[Any] = ...,
    steps: int = ...,
) -> WarmedDecorator: ...
def warmed(
    fn: Callable[P, R] | None = None,
    /,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Iterable[Any] = (),
    steps: int = 1,
) -> Callable[P, R] | WarmedDecorator:
    """Wrap a step function so its first call is preceded by warm-up calls that leave no trace.

    On the first call, ``fn(*args, **kwargs)`` runs ``steps`` times inside
    :class:`preserve_state` for ``model``, ``optimizer`` and ``extra``; then the real
    call runs and its result is returned. Later calls go straight to ``fn``. The
    promise covers what you pass: anything else the step changes (a global step
    counter, a logger, data pulled from an iterator) is not rolled back, so put
    schedulers, GradScalers and ``autocast_step`` objects in ``extra``.

    >>> import copy, torch
    >>> from cudakit.warmup import warmed
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> twin = copy.deepcopy(model)
    >>> calls = []
    >>> @warmed(model=model, optimizer=opt, steps=2)
    ... def step(m, x):
    ...     calls.append(x)
    ...     opt.zero_grad()
    ...     m(x).square().mean().backward()
    ...     opt.step()
    >>> # 2 warm-up calls, rolled back, then the real one
    >>> step(model, torch.ones(4, 2))
    >>> len(calls)
    3
    >>> twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    >>> twin(torch.ones(4, 2)).square().mean().backward()
    >>> twin_opt.step()
    >>> torch.equal(model.weight, twin.weight)   # exactly one step happened
    True

    Args:
        fn: The step function; omit it to use ``@warmed(model=...)`` as a decorator.
        model: The module the step trains.
        optimizer: Its optimizer, if the step steps one.
        extra: Further objects with ``state_dict()``/``load_state_dict()``, tensors and
            ``torch.Generator`` objects to roll back.
        steps: Number of warm-up calls before the first real one, at least 1.

    Returns:
        The wrapped function (same signature), or a decorator producing it.

    Raises:
        TypeError: ``fn`` is not callable or is a generator/coroutine function, or a
            wrong type for the other arguments.
        ValueError: ``steps < 1``.

    .. versionadded:: 0.1
    """
    module = check_model(model, "warmed")
    opt = check_optimizer(optimizer, "warmed")
    extra_items = check_extra("warmed", extra)
    if module is None:
        raise TypeError(
            "warmed() needs model=, the module the step function trains, so that the warm-up "
            "calls can be rolled back. Write @warmed(model=model, optimizer=optimizer)."
        )
    steps = check_int("warmed", "steps", steps, minimum=1)  # a NumPy int too
    guard = preserve_state(module, opt, extra=extra_items)

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        check_callable(
            "warmed",
            "func",
            func,
            expected="a step function to wrap",
            fix="Use @warmed(model=model, optimizer=optimizer) above a `def`.",
        )
        reject_deferred_body(
            func, "warmed() cannot wrap", "Wrap a plain step function.", ", outside the rollback"
        )
        lock = threading.Lock()
        done = False

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            nonlocal done
            if not done:
                with lock:
                    if not done:
                        with guard.clone():
                            for _ in range(steps):
                                func(*args, **kwargs)
                        done = True
            return func(*args, **kwargs)

        return wrapper

    if fn is None:
        return decorate  # type: ignore[return-value]
    return decorate(fn)
