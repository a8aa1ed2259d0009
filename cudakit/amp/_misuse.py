"""What misusing an :class:`~cudakit.amp.AutocastStep` raises: the messages, in one place.

Each function returns (or raises) the error for one misuse, naming what happened and
the fix; the step decides when. Nothing here changes any state. :class:`AttributeGuard`
refuses setting an attribute the step does not have (a typo) or one fixed when it was
built, instead of accepting it and ignoring it.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from typing import Any

import torch

from .._check import check_callable

__all__ = [
    "AttributeGuard",
    "accumulate_busy_error",
    "accumulate_mid_window_error",
    "check_decorated",
    "check_idle",
    "comm_hook_flush_error",
    "dropped_window_note",
    "flush_before_backward_error",
    "flush_inside_error",
    "grads_changed_error",
    "last_micro_step_busy_error",
    "load_busy_error",
    "mixed_weights_error",
    "nested_error",
    "no_grad_error",
    "no_parameter_reached_error",
    "same_loss_error",
    "warn_block_compile",
]


def check_decorated(func: Any) -> None:
    """Refuse what ``@step`` cannot decorate: a tensor, a non-callable, a generator."""
    if isinstance(func, torch.Tensor):
        raise TypeError(
            "AutocastStep called with a tensor: the step object decorates a loss "
            "function. To step on a loss you computed yourself, call step.backward(loss)."
        )
    check_callable(
        "AutocastStep",
        "func",
        func,
        expected="a function to decorate",
        fix="Write @autocast_step(optimizer, ...) above a `def`.",
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


def last_micro_step_busy_error() -> RuntimeError:
    """``last_micro_step()`` entered once the micro-step has decided how it syncs."""
    return RuntimeError(
        "AutocastStep.last_micro_step() entered inside `with step:` or the step function, "
        "or between the block and its step.backward(): this micro-step already decided "
        "whether it syncs gradients. Enter it around the whole micro-step: "
        "`with step.last_micro_step():` before `with step:` (or around the call of the "
        "step function)."
    )


def accumulate_mid_window_error(position: int, accumulate: int) -> ValueError:
    """``accumulate`` set while the window holds micro-steps."""
    return ValueError(
        f"AutocastStep.accumulate can change only between windows: this window holds "
        f"{position} of {accumulate} micro-steps. Set it after the window's "
        "optimizer step (e.g. at the start of an epoch), or call step.flush() first."
    )


def flush_before_backward_error() -> RuntimeError:
    """``flush()`` called after ``with step:`` and before its ``step.backward(loss)``."""
    return RuntimeError(
        "AutocastStep.flush() called between `with step:` and step.backward(loss): that "
        "micro-step has run its forward but not its backward, so the window is not "
        "complete. Call step.backward(loss) first, then flush()."
    )


def check_idle(step: object, active: tuple[object, str] | None, awaiting: bool) -> None:
    """Refuse ``load_state_dict()`` while a micro-step of ``step`` runs."""
    if active is not None and active[0] is step:
        where = "the step function" if active[1] == "decorated" else "`with step:`"
        raise load_busy_error(f"inside {where}")
    if awaiting:
        raise load_busy_error("between `with step:` and step.backward(loss)")


def load_busy_error(where: str) -> RuntimeError:
    """``load_state_dict()`` called while a micro-step runs (``where`` says where)."""
    return RuntimeError(
        f"AutocastStep.load_state_dict() called {where}: the micro-step running there "
        "would mix its gradients into the loaded window. Load the state between calls "
        "(before the training loop, or after a step.backward(loss) or a call of the "
        "step function has returned)."
    )


def same_loss_error(decorated: bool) -> RuntimeError:
    """The loss tensor of the previous micro-step, passed again."""
    where = "autocast_step: the step function" if decorated else "AutocastStep.backward()"
    return RuntimeError(
        f"{where} got the loss tensor of the previous call again; its backward already "
        "ran (and freed its graph), so a second one would add its gradients twice or "
        "fail halfway in autograd. Compute a new loss for every micro-step (run the "
        "forward again); nothing was changed."
    )


def grads_changed_error(position: int, accumulate: int, cleared: bool) -> RuntimeError:
    """The window's gradients vanished (or were replaced) between micro-steps."""
    what = "were cleared" if cleared else "were replaced by other tensors"
    return RuntimeError(
        f"AutocastStep: the gradients this window accumulated over its first {position} "
        f"of {accumulate} micro-steps {what} since the last one: is an "
        "optimizer.zero_grad() or model.zero_grad() left in the loop? autocast_step "
        "clears the gradients itself when a window opens (and clips once per window with "
        "max_grad_norm=); remove that call. This call changed nothing; the window's "
        "earlier gradients are lost, so restart the window from a checkpoint or accept "
        "its loss."
    )


def no_parameter_reached_error(count: int) -> ValueError:
    """A window whose losses reached none of the optimizers' parameters."""
    return ValueError(
        f"autocast_step: the window's loss reached none of the optimizers' {count} "
        "parameters (none has a .grad after backward), so there is nothing to step; the "
        "window was dropped, nothing stepped. Is the loss computed through the model "
        "these optimizers train (not a frozen copy, detached outputs, or another "
        "model)?"
    )


def comm_hook_flush_error(hook: str) -> RuntimeError:
    """``flush()`` of a partial window under DDP with a communication hook."""
    return RuntimeError(
        f"AutocastStep.flush() of a partial window: the DDP model has the communication "
        f"hook {hook} (register_comm_hook), and the window's micro-steps ran without "
        "gradient sync. flush() cannot run that hook on them (it reduces only during "
        "DDP's own backward), and a plain all-reduce would bypass it and differ from your "
        "loop. Let the epoch's last micro-step sync through DDP's backward: iterate with "
        "Checkpointer.batches() or cudakit.prefetch(loader, step=step), which know where "
        "the epoch ends, or run that micro-step inside `with step.last_micro_step():`. "
        "Or make each epoch a multiple of accumulate= (DataLoader(drop_last=True)), "
        "or drop the hook. Nothing was changed."
    )


def dropped_window_note(kind: str | None, position: int) -> str:
    """What a failure in a backward that cannot be rolled back did to the window."""
    where = "FSDP2's" if kind == "fsdp" else "DDP's synchronised"
    return (
        f"autocast_step: this failure came inside {where} backward of micro-step "
        f"{position + 1}, which cannot be rolled back (its gradients were being reduced "
        "across ranks), so the window was dropped: gradients cleared, buffers put back, "
        "position 0. Other ranks may not have failed; resume every rank from a "
        "checkpoint."
    )


def warn_block_compile() -> None:
    """Warn (once per step) that ``compile=`` does not reach ``step.backward(loss)``."""
    warnings.warn(
        "autocast_step(compile=...) compiles the decorated loss function; a loss "
        "computed yourself and passed to step.backward() ran as written, "
        "uncompiled. Decorate the function that computes the loss (@step), or "
        "compile the model yourself (model = torch.compile(model)).",
        UserWarning,
        stacklevel=3,
    )


# ------------------------------------------------------------------ attributes

#: What a read-only attribute is built from (the rest: ``autocast_step(..., name=...)``).
_BUILT_FROM = {
    "optimizer": "autocast_step(optimizer, ...)",
    "optimizers": "autocast_step([opt_a, opt_b], ...)",
    "scheduler": "autocast_step(..., scheduler=...)",
    "schedulers": "autocast_step(..., scheduler=[...])",
    "compile_options": "autocast_step(..., compile=...)",
    "device_type": "autocast_step(...) from the optimizer's parameters (move them first)",
}


class AttributeGuard:
    """Refuse setting a misspelled attribute, or one fixed when the object was built.

    Names starting with ``_`` are the object's own, and any name may be set until
    ``_sealed`` is (the end of ``__init__``); properties with a setter stay settable.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name[0] == "_" or not self.__dict__.get("_sealed"):
            object.__setattr__(self, name, value)
            return
        attr = getattr(type(self), name, None)
        if isinstance(attr, property) and attr.fset is not None:
            attr.fset(self, value)
            return
        raise _attribute_error(self, name, "set")

    def __delattr__(self, name: str) -> None:
        if name[0] == "_":
            object.__delattr__(self, name)
            return
        raise _attribute_error(self, name, "delete")


def _settable(obj: object) -> list[str]:
    return sorted(
        n
        for n in dir(type(obj))
        if not n.startswith("_")
        and isinstance(getattr(type(obj), n), property)
        and getattr(type(obj), n).fset is not None
    )


def _attribute_error(obj: object, name: str, verb: str) -> AttributeError:
    owner = type(obj).__name__
    settable = _settable(obj)
    can = f"the settable attributes are {' and '.join(settable)}"
    if name not in dir(obj):  # (hasattr would run properties: a counter settles)
        public = [n for n in dir(obj) if not n.startswith("_")]
        close = difflib.get_close_matches(name, public, n=1)
        hint = f"did you mean {close[0]!r}? The {can[4:]}" if close else can
        return AttributeError(
            f"{owner} has no attribute {name!r} to {verb}; {hint}; the others are fixed "
            "when the step is built (autocast_step(...))."
        )
    if name in _BUILT_FROM or name in getattr(type(obj), "_OPTIONS", ()):
        built = _BUILT_FROM.get(name, f"autocast_step(..., {name}=...)")
        why = (
            f"it is fixed when the step is built. Build a new step with {built}; "
            "new_step.load_state_dict(step.state_dict()) carries the scaler, the counters "
            "and an open window over"
        )
    else:
        why = f"the step keeps it itself ({can})"
    return AttributeError(f"{owner}.{name} is read-only: {why}.")
