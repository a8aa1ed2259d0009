"""What misusing an :class:`~cudakit.amp.AutocastStep` raises: the messages, in one place.

Each function returns (or raises) the error for one misuse, naming what happened and
the fix; the step decides when. Nothing here changes any state.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = [
    "accumulate_busy_error",
    "accumulate_mid_window_error",
    "check_decorated",
    "flush_inside_error",
    "mixed_weights_error",
    "nested_error",
    "no_grad_error",
]


def check_decorated(func: Any) -> None:
    """Refuse what ``@step`` cannot decorate: a tensor, a non-callable, a generator."""
    if isinstance(func, torch.Tensor):
        raise TypeError(
            "AutocastStep called with a tensor: the step object decorates a loss "
            "function. To step on a loss you computed yourself, call step.backward(loss)."
        )
    if not callable(func):
        raise TypeError(
            f"AutocastStep used as a decorator expects a function, got "
            f"{type(func).__name__}; write @autocast_step(optimizer, ...) above a `def`."
        )
    if inspect.isgeneratorfunction(func) or inspect.iscoroutinefunction(func):
        raise TypeError(
            f"autocast_step cannot decorate the generator or coroutine function "
            f"{getattr(func, '__qualname__', func)!r}; decorate a plain function that "
            "returns the loss."
        )


def no_grad_error() -> ValueError:
    """A step called under ``torch.no_grad()`` or ``inference_mode()``."""
    return ValueError(
        "autocast_step: gradients are disabled here (torch.no_grad() or "
        "torch.inference_mode() is active), so the loss does not require grad and there "
        "is nothing to backpropagate. Call the training step outside that block; the "
        "gradients, weights and counters were left as they were."
    )


def nested_error(same: bool) -> RuntimeError:
    """A step called inside a step (``same``: inside itself)."""
    where = "the same" if same else "another"
    return RuntimeError(
        f"autocast_step called inside {where} autocast_step: the outer step would "
        "backpropagate and step the optimizer around this one. Call the two steps one "
        "after the other (e.g. the discriminator step, then the generator step), not "
        "nested."
    )


def mixed_weights_error() -> ValueError:
    """A window whose micro-steps return a token weight only some of the time."""
    return ValueError(
        "autocast_step: within one accumulation window every micro-step must return "
        "{'loss': summed_loss, 'weight': count}, or none may; this one differs from "
        "the window's first. Return the weight from every call of the step function."
    )


def flush_inside_error() -> RuntimeError:
    """``flush()`` called inside a step function or a ``with step:`` block."""
    return RuntimeError(
        "AutocastStep.flush() called inside a step: call it after the loop over "
        "the epoch's batches, outside the decorated function or `with step:` block."
    )


def accumulate_busy_error() -> ValueError:
    """``accumulate`` set while a micro-step has already decided how it syncs."""
    return ValueError(
        "AutocastStep.accumulate cannot change inside `with step:` or the step "
        "function, nor between the block and its step.backward(): this micro-step "
        "already decided whether it syncs gradients and steps. Set it between "
        "calls, after the window's optimizer step."
    )


def accumulate_mid_window_error(position: int, accumulate: int) -> ValueError:
    """``accumulate`` set while the window holds micro-steps."""
    return ValueError(
        f"AutocastStep.accumulate can change only between windows: this window holds "
        f"{position} of {accumulate} micro-steps. Set it after the window's "
        "optimizer step (e.g. at the start of an epoch), or call step.flush() first."
    )
