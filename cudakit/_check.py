"""Argument validators shared by every public function (attrs' ``validators.py`` style).

Each validator checks one argument and raises at the door, before anything happens:
``TypeError`` for a wrong kind, ``ValueError`` for a wrong value. Every message names
the function and the argument, says what came and what is expected, and ends with the
fix, for example:

    check_int("autocast_step", "accumulate", "4", minimum=1)
    # TypeError: autocast_step(accumulate=...) expects an int >= 1, got str '4'. ...

Validators return the value (converted where that is lossless, e.g. an int to a
float), so a call site reads ``accumulate = check_int(...)``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection, Iterable
from typing import Any, NoReturn, TypeGuard, TypeVar

import torch

__all__ = [
    "check_bool",
    "check_callable",
    "check_choice",
    "check_device",
    "check_extra",
    "check_int",
    "check_number",
    "check_optional",
    "check_type",
    "describe",
    "fail_type",
    "fail_value",
    "for_attribute",
    "is_int",
    "is_real",
    "name_error",
]

T = TypeVar("T")


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int, NumPy's too; a bool is not."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[float]:
    """Whether ``value`` is a real number (an int or float, NumPy's too); a bool is not."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def describe(value: object, limit: int = 60) -> str:
    """``type repr`` of a value for a message, the repr shortened to ``limit`` characters."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(value).__name__} {text}"


def _message(func: str, arg: str, expected: str, value: object, fix: str) -> str:
    head = f"{func}({arg}=...) expects {expected}, got {describe(value)}."
    return f"{head} {fix}" if fix else head


def fail_type(func: str, arg: str, expected: str, value: object, fix: str = "") -> NoReturn:
    """Raise the ``TypeError`` for a wrong kind of argument."""
    raise TypeError(_message(func, arg, expected, value, fix))


def fail_value(func: str, arg: str, expected: str, value: object, fix: str = "") -> NoReturn:
    """Raise the ``ValueError`` for an argument of the right kind but a wrong value."""
    raise ValueError(_message(func, arg, expected, value, fix))


def check_type(
    func: str,
    arg: str,
    value: object,
    types: type[T] | tuple[type[Any], ...],
    *,
    expected: str,
    fix: str = "",
) -> T:
    """``value`` if it is an instance of ``types``, else ``TypeError``."""
    if not isinstance(value, types):
        fail_type(func, arg, expected, value, fix)
    return value


def check_bool(
    func: str, arg: str, value: object, *, expected: str = "True or False", fix: str = ""
) -> bool:
    """``value`` if it is a bool (not merely truthy: ``"no"`` is refused)."""
    if not isinstance(value, bool):
        fail_type(func, arg, expected, value, fix or f"Pass {arg}=True or {arg}=False.")
    return value


def check_int(
    func: str,
    arg: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    expected: str = "",
    fix: str = "",
) -> int:
    """``int(value)`` for an int (NumPy's too; bools refused) within ``[minimum, maximum]``.

    ``expected`` replaces the words for what is expected (``"an int >= 1 or None"``).
    """
    expected = expected or f"an int{_bounds(minimum, maximum)}"
    fix = fix or _example(arg, _int_example(minimum, maximum))
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail_type(func, arg, expected, value, fix)
    number = int(value)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        fail_value(func, arg, expected, value, fix)
    return number


def _int_example(minimum: int | None, maximum: int | None) -> int:
    """A small allowed int for a message's example: 1 where it fits, else a bound."""
    example = 1 if minimum is None else max(minimum, 1)
    return example if maximum is None else min(example, maximum)


def _example(arg: str, example: object) -> str:
    """The default fix of a message: an example of the argument, ``Pass e.g. every=1.``"""
    return f"Pass e.g. {arg}={example!r}." if arg.isidentifier() else ""


def check_number(
    func: str,
    arg: str,
    value: object,
    *,
    positive: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
    below: float | None = None,
    finite: bool = True,
    expected: str = "",
    fix: str = "",
) -> float:
    """``float(value)`` for a real number (NumPy's too; bools refused), finite and in range.

    ``minimum`` and ``maximum`` are inclusive bounds, ``below`` an exclusive upper one,
    ``positive`` means ``> 0``; ``expected`` replaces the words for what is expected.
    """
    expected = expected or _number_expected(positive, minimum, maximum, below, finite)
    fix = fix or _example(arg, _number_example(positive, minimum, maximum, below))
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail_type(func, arg, expected, value, fix)
    number = float(value)
    if (
        (finite and not math.isfinite(number))
        or math.isnan(number)
        or (positive and number <= 0)
        or (minimum is not None and number < minimum)
        or (maximum is not None and number > maximum)
        or (below is not None and number >= below)
    ):
        fail_value(func, arg, expected, value, fix)
    return number


def _number_example(
    positive: bool, minimum: float | None, maximum: float | None, below: float | None
) -> float:
    """An allowed number for a message's example: 1.0 where it fits, else within range."""
    low = float(minimum) if minimum is not None else 0.0
    example = max(1.0, low)
    if maximum is not None:
        example = min(example, float(maximum))
    if below is not None and example >= below:
        example = (max(low, 0.0) + below) / 2 if below > low else below - 1.0
    if positive and example <= 0:
        example = 1.0
    return example


def _number_expected(
    positive: bool,
    minimum: float | None,
    maximum: float | None,
    below: float | None,
    finite: bool,
) -> str:
    """What :func:`check_number` expects, in words: ``a finite number in [0, 1)``."""
    kind = "finite number" if finite else "number"
    if positive and maximum is None and below is None:
        return f"a positive {kind}"
    low = "(0" if positive else f"[{minimum:g}" if minimum is not None else ""
    high = f"{maximum:g}]" if maximum is not None else f"{below:g})" if below is not None else ""
    if low and high:
        return f"a {kind} in {low}, {high}"
    if minimum is not None:
        return f"a {kind} >= {minimum:g}"
    if high:
        return f"a {kind} {'<=' if maximum is not None else '<'} {high[:-1]}"
    return f"a {kind}"


def check_choice(
    func: str, arg: str, value: object, choices: Collection[Any], *, fix: str = ""
) -> Any:
    """``value`` if it is one of ``choices`` (a str, say), else ``TypeError``/``ValueError``."""
    names = ", ".join(repr(c) for c in choices)
    expected = f"one of {names}"
    fix = fix or (_example(arg, next(iter(choices))) if choices else "")
    kinds = {type(c) for c in choices}
    if not any(isinstance(value, k) for k in kinds):
        fail_type(func, arg, expected, value, fix)
    if value not in choices:
        fail_value(func, arg, expected, value, fix)
    return value


def check_callable(
    func: str, arg: str, value: object, *, expected: str, fix: str = ""
) -> Callable[..., Any]:
    """``value`` if it is callable, else ``TypeError``."""
    if not callable(value):
        fail_type(func, arg, expected, value, fix)
    return value


#: What ``extra=`` holds: objects with ``state_dict()``/``load_state_dict()``, tensors, RNGs.
_EXTRA_ITEM = "objects with state_dict() and load_state_dict(), tensors or torch.Generator objects"
_EXTRA = f"a tuple of {_EXTRA_ITEM}"


def check_extra(func: str, value: object, *, fix: str = "") -> tuple[Any, ...]:
    """``extra=`` as a tuple: objects with ``state_dict()`` and ``load_state_dict()``,
    tensors and ``torch.Generator`` objects; a class or anything else is refused.

    ``fix`` ends the message for an item that is none of these (default: leave it out).
    """
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes)):
        fail_type(func, "extra", _EXTRA, value, "For one object write extra=(obj,).")
    items = tuple(value)
    for obj in items:
        if isinstance(obj, type):
            name = obj.__name__
            fail_type(
                func,
                "extra",
                "objects, not classes",
                obj,
                f"Pass the {name} you train with, e.g. extra=(obj,) where obj = {name}(...).",
            )
        if isinstance(obj, (torch.Tensor, torch.Generator)) or (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            continue
        fail_type(
            func,
            "extra",
            _EXTRA_ITEM,
            obj,
            fix or "Leave it out, or put back yourself what the call changes in it.",
        )
    return items


def check_optional(
    check: Callable[..., T], func: str, arg: str, value: object, **kwargs: Any
) -> T | None:
    """None, or ``check(func, arg, value, **kwargs)``."""
    if value is None:
        return None
    return check(func, arg, value, **kwargs)


def _bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" from {minimum} to {maximum}"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def for_attribute(owner: str, attr: str, exc: Exception) -> Exception:
    """``exc`` from a validator, reworded for an assignment: ``owner.attr = ... expects``."""
    return _retext(exc, str(exc).replace(f"{owner}({attr}=...)", f"{owner}.{attr} = ...", 1))


def check_device(func: str, arg: str, value: object, resolve: Callable[[Any], T]) -> T:
    """``resolve(value)`` (``resolve_device``), its error naming ``func`` and ``arg``.

    The resolver is passed in, so this module imports nothing of cudakit's. The
    error keeps its type (``TypeError``, ``DeviceError``) and its text, prefixed with
    ``func(arg=value):``. A resolver that names itself in its errors (the public
    ``resolve_device``) is called through its plain form, ``resolve.__wrapped__``.
    """
    resolve = getattr(resolve, "__wrapped__", resolve)
    try:
        return resolve(value)
    except (TypeError, ValueError) as exc:
        raise name_error(func, arg, value, exc) from None


def name_error(func: str, arg: str, value: object, exc: Exception) -> Exception:
    """``exc`` again, its text prefixed with the public function and the argument.

    ``func(arg=value): ...``, the text's own leading ``arg=value`` folded into that
    prefix; ``func(): ...`` when the text shows ``arg=value`` further on. The type is
    kept (a ``DeviceError`` stays one).
    """
    text = str(exc)
    shown = f"{arg}={value!r}"
    if text.startswith(shown):
        text = f"{func}({shown}): {text[len(shown) :].lstrip()}"
    elif shown in text:
        text = f"{func}(): {text}"
    else:
        text = f"{func}({shown}): {text}"
    return _retext(exc, text)


def _retext(exc: Exception, text: str) -> Exception:
    """``exc``'s type with ``text``; ``exc`` itself for a type that takes other arguments."""
    try:
        return type(exc)(text)
    except Exception:
        return exc
