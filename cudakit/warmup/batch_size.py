"""The largest batch size that fits in memory: :func:`find_batch_size`."""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, Protocol, TypeVar, overload

import torch
from typing_extensions import ParamSpec

from .._check import check_callable, check_int, check_number
from .._oom import is_oom_error
from ..exceptions import BatchSizeSearchError

P = ParamSpec("P")
R = TypeVar("R")

_log = logging.getLogger("cudakit.warmup")

__all__ = ["FindBatchSizeDecorator", "find_batch_size", "free_memory"]


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _positive_int(name: str, value: object) -> int:
    fix = f"Batch sizes count samples, so {name} >= 1: pass e.g. {name}=32."
    return check_int("find_batch_size", name, value, minimum=1, fix=fix)  # a NumPy int too


@dataclass(frozen=True)
class _Search:
    start: int
    lower: int
    upper: int | None
    multiple_of: int
    margin: float

    @classmethod
    def checked(
        cls, start: object, lower: object, upper: object, multiple_of: object, margin: object
    ) -> _Search:
        s = _positive_int("start", start)
        lo = _positive_int("lower", lower)
        hi = None if upper is None else _positive_int("upper", upper)
        m = _positive_int("multiple_of", multiple_of)
        margin = check_number(
            "find_batch_size",
            "margin",
            margin,
            minimum=0.0,
            below=1.0,
            fix="It is the fraction to back off from the largest size that fits: pass e.g. "
            "margin=0.1, or leave it out.",
        )
        if hi is not None and hi < lo:
            raise ValueError(
                f"find_batch_size() got upper={hi} below lower={lo}; swap them or widen the range."
            )
        first = -(-lo // m) * m
        if hi is not None and first > hi:
            raise ValueError(
                f"find_batch_size() found no multiple of {m} between lower={lo} and upper={hi}. "
                f"Widen the range or use a smaller multiple_of."
            )
        return cls(s, lo, hi, m, float(margin))

    def run(self, trial: Callable[[int], R]) -> tuple[int, R | None]:
        """Search; return (largest fitting size, the trial's result there).

        Sizes are counted in units of ``multiple_of``. Every success is above the
        previous best and every failure below the previous first failure, so one
        attempt() updates both ends of the bracket.
        """
        m = self.multiple_of
        lo = -(-self.lower // m)
        hi = None if self.upper is None else self.upper // m
        k = max(lo, self.start // m)
        if hi is not None:
            k = min(k, hi)
        tried: list[int] = []
        best: int | None = None  # largest size that fit
        best_result: R | None = None
        fail: int | None = None  # smallest size that did not
        last_oom = ""

        def attempt(k: int) -> bool:
            nonlocal best, best_result, fail, last_oom
            try:
                result = trial(k * m)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                last_oom = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                fail = k
            else:
                best, best_result = k, result
                del result
            free_memory()  # outside `except`: the traceback and its tensors are gone
            tried.append(k * m)
            _log.debug("find_batch_size: %d %s", k * m, "fits" if best == k else "out of memory")
            return best == k

        if attempt(k):  # grow geometrically up to the first failure (or upper)
            while (hi is None or k < hi) and attempt(k := 2 * k if hi is None else min(2 * k, hi)):
                if hi is None and k * m >= _GROWTH_LIMIT:
                    raise BatchSizeSearchError(
                        f"find_batch_size(): the trial still fits at batch size {k * m} "
                        f"(tried {', '.join(map(str, tried))}), so it does not seem to use its "
                        "batch size (or never runs out of memory). Check that trial_fn builds "
                        "a batch of the size it is given, or set upper=."
                    )
        else:  # shrink geometrically down to the first success (or lower)
            while k > lo and not attempt(k := max(k // 2, lo)):
                pass
        if best is None:
            raise BatchSizeSearchError(
                f"find_batch_size(): not even the lower bound batch size {lo * m} fits "
                f"in memory (tried {', '.join(map(str, tried))}; last error: {last_oom}). "
                "Lower `lower=`, shrink the model or sequence length, train in bfloat16 "
                "(autocast_step), accumulate gradients over smaller batches, or free "
                "memory held elsewhere (see torch.cuda.memory_summary())."
            )
        while fail is not None and fail - best > 1:  # bisect between them
            attempt((best + fail) // 2)
        return best * m, best_result

    def final(self, largest: int) -> int:
        """The size to use: ``largest`` backed off by ``margin``, a multiple, >= lower."""
        m = self.multiple_of
        backed = math.floor(largest * (1.0 - self.margin) + 1e-9) // m * m
        return max(backed, -(-self.lower // m) * m)


_POSITIONAL = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.VAR_POSITIONAL,
)

#: Without ``upper``, growing past this many samples means the trial ignores its size.
_GROWTH_LIMIT = 2**31


def _check_trial(fn: Callable[..., Any], what: str) -> None:
    if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"{what} a function that runs at each batch size, but "
            f"{getattr(fn, '__qualname__', fn)!r} is a generator or coroutine function: "
            "calling it runs nothing, so every size would seem to fit. Pass a plain function."
        )


class FindBatchSizeDecorator(Protocol):
    """What ``find_batch_size(...)`` returns when no ``trial_fn`` is given: the decorator.

    Calling it on ``def fn(batch_size, *args, **kwargs)`` gives a function of the
    remaining arguments: each call searches for the batch size afresh and returns
    ``fn``'s result at it (``@find_batch_size(start=16)`` above a ``def``). A type for
    annotations; at run time the decorator is a plain function.

    .. versionadded:: 0.1
    """

    def __call__(self, fn: Callable[Concatenate[int, P], R], /) -> Callable[P, R]:
        """Wrap ``fn``, whose first parameter is the batch size the search chooses."""


@overload
def find_batch_size(
    trial_fn: Callable[[int], object],
    /,
    *,
    start: int = ...,
    lower: int = ...,
    upper: int | None = ...,
    multiple_of: int = ...,
    margin: float = ...,
) -> int: ...
@overload
def find_batch_size(
    trial_fn: None = None,
    /,
    *,
    start: int = ...,
    lower: int = ...,
    upper: int | None = ...,
    multiple_of: int = ...,
    margin: float = ...,
) -> FindBatchSizeDecorator: ...
def find_batch_size(
    trial_fn: Callable[[int], object] | None = None,
    /,
    *,
    start: int = 32,
    lower: int = 1,
    upper: int | None = None,
    multiple_of: int = 1,
    margin: float = 0.0,
) -> int | FindBatchSizeDecorator:
    """Find the largest batch size at which ``trial_fn(batch_size)`` fits in memory.

    Starting at ``start``, the size doubles while trials succeed (halves while they
    fail), then bisects between the last success and the first failure, so the
    number of trials is logarithmic. Only sizes that are multiples of
    ``multiple_of`` within ``[lower, upper]`` are tried. Out-of-memory failures
    (``torch.OutOfMemoryError`` and its messages) mark a size as too big; garbage collection and
    ``torch.cuda.empty_cache()`` run between trials; every other exception
    propagates unchanged. Memory use is assumed to grow with the batch size.

    >>> from cudakit.warmup import find_batch_size
    >>> def trial(batch_size):
    ...     if batch_size > 100:
    ...         raise torch.OutOfMemoryError("CUDA out of memory.")
    >>> find_batch_size(trial, start=16)
    100
    >>> find_batch_size(trial, start=16, multiple_of=8)
    96
    >>> find_batch_size(trial, start=16, multiple_of=8, margin=0.1)
    80

    As a decorator over ``def fn(batch_size, *args, **kwargs)``, calling
    ``fn(*args, **kwargs)`` runs a fresh search (nothing is remembered between calls)
    and returns ``fn``'s result at the chosen size. The trials are real calls, so
    the function should be one or a few steps (wrap model updates in
    :class:`preserve_state`), and should return something small: the result of the
    best trial so far is kept while the search goes on.

    >>> @find_batch_size(start=16, upper=64, multiple_of=8)
    ... def probe(batch_size, width):
    ...     return torch.zeros(batch_size, width).shape
    >>> probe(3)
    torch.Size([64, 3])

    Args:
        trial_fn: Called with a batch size; raises an out-of-memory error when the
            size does not fit. Omit it to get the decorator.
        start: First size tried (rounded down to a multiple, clamped to the bounds).
        lower: Smallest acceptable size.
        upper: Largest size to try; ``None`` grows until the first failure (on CPU,
            where the kernel may kill the process instead of raising, set it).
        multiple_of: Every size tried and returned is a multiple of this (8 suits
            tensor cores).
        margin: Fraction to back off from the largest size that fit, e.g. ``0.1``
            returns 90% of it (rounded down to a multiple, never below ``lower``), as
            headroom for fragmentation and longer inputs later.

    Returns:
        The batch size; with the decorator, ``fn``'s result at that size (``fn`` is
        called once more when ``margin`` moved the size off the tried ones).

    Raises:
        BatchSizeSearchError: even ``lower`` runs out of memory.
        TypeError: a non-int bound, a non-callable ``trial_fn``, or ``batch_size``
            passed to the decorated function.
        ValueError: bounds that contain no valid size, or ``margin`` outside [0, 1).

    .. versionadded:: 0.1
    """
    search = _Search.checked(start, lower, upper, multiple_of, margin)
    if trial_fn is not None:
        check_callable(
            "find_batch_size",
            "trial_fn",
            trial_fn,
            expected="a function of the batch size",
            fix="Pass it positionally: find_batch_size(trial, ...).",
        )
        _check_trial(trial_fn, "find_batch_size() calls")
        largest, _ = search.run(trial_fn)
        return search.final(largest)

    def decorate(fn: Callable[Concatenate[int, P], R]) -> Callable[P, R]:
        check_callable(
            "find_batch_size",
            "fn",
            fn,
            expected="a function whose first parameter is the batch size",
            fix="Write @find_batch_size(...) above a `def`.",
        )
        _check_trial(fn, "@find_batch_size(...) decorates")
        try:
            signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None
        params = [] if signature is None else list(signature.parameters.values())
        if signature is not None and (not params or params[0].kind not in _POSITIONAL):
            raise TypeError(
                f"@find_batch_size(...) passes the batch size as the first positional "
                f"argument, but {getattr(fn, '__qualname__', fn)}{signature} has no such "
                "parameter. Write `def fn(batch_size, ...)`."
            )

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            name = getattr(fn, "__name__", "fn")
            if "batch_size" in kwargs:
                raise TypeError(
                    f"{name}() is decorated with @find_batch_size(...), which passes the batch "
                    f"size itself; call {name}(...) without batch_size=."
                )
            if signature is not None:
                try:
                    signature.bind(0, *args, **kwargs)
                except TypeError as exc:
                    raise TypeError(
                        f"{name}() is decorated with @find_batch_size(...), which passes the "
                        f"batch size as the first argument; call it with the remaining "
                        f"arguments only ({exc})."
                    ) from None
            largest, result = search.run(lambda bs: fn(bs, *args, **kwargs))
            chosen = search.final(largest)
            if chosen == largest:
                return result  # type: ignore[return-value]
            return fn(chosen, *args, **kwargs)

        if signature is not None and params[0].kind != inspect.Parameter.VAR_POSITIONAL:
            wrapper.__signature__ = signature.replace(parameters=params[1:])  # type: ignore[attr-defined]
        return wrapper

    return decorate
