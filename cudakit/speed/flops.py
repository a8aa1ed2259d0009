"""Counting the FLOPs of one training step: :func:`count_flops` and :class:`FlopCount`.

The count comes from ``torch.utils.flop_counter.FlopCounterMode`` over one real
forward and backward, not from a formula guessed from the parameter count: it sees
every matmul, convolution and attention the step runs, at the shapes it runs them.
The pass runs inside :class:`~cudakit.warmup.preserve_state`, so the weights, the
gradients, the optimizer state, BatchNorm's running statistics and every random
number generator are as they were afterwards.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .._check import check_callable, check_extra, check_optional, check_type, describe
from ..amp import AutocastStep, StepResult
from ..warmup import preserve_state
from ._formulas import Formulas

__all__ = ["FlopCount", "batch_of", "batch_position", "count_flops"]


@dataclass(frozen=True)
class FlopCount:
    """The model FLOPs one call of a step function ran, and the batch it ran them on.

    ``int(count)`` is :attr:`total`, the model FLOPs MFU is measured on: what the
    model's maths needs, once. What the hardware computes again (the scores a fused
    attention's backward recomputes, a forward rerun by activation checkpointing) is
    :attr:`recomputed`, and :attr:`hardware` is both. :func:`~cudakit.speed.speed_report`
    scales the count to other batches through :attr:`example` (see ``flops=`` there).

    >>> c = FlopCount(total=300, forward=100, example=None, recomputed=20)
    >>> int(c), c.backward, c.hardware
    (300, 200, 320)

    .. versionadded:: 0.1
    """

    #: Model FLOPs of the forward and the backward together.
    total: int
    #: FLOPs of the forward alone; None when the function ran backward itself
    #: (a function decorated with ``autocast_step``).
    forward: int | None
    #: The call's first argument (the example batch), kept to scale the count.
    example: Any = field(repr=False, compare=False)
    #: FLOPs the hardware ran again, outside the model FLOPs (0: none).
    recomputed: int = 0

    @property
    def backward(self) -> int | None:
        """FLOPs of the backward alone (``total - forward``), when known."""
        return None if self.forward is None else self.total - self.forward

    @property
    def hardware(self) -> int:
        """Hardware FLOPs: the model FLOPs and the recomputed ones; MFU never counts these."""
        return self.total + self.recomputed

    def __int__(self) -> int:
        return self.total


def batch_position(func: Callable[..., Any]) -> int:
    """Where ``func``'s batch is: 1 for a method (first parameter ``self`` or ``cls``), else 0."""
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # no signature (some builtins): a plain function
        return 0
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first = parameters[0] if parameters else None
    return int(first is not None and first.kind in positional and first.name in ("self", "cls"))


def batch_of(args: tuple[Any, ...], kwargs: Mapping[str, Any], skip: int = 0) -> Any:
    """The batch of a call: its positional argument after ``skip``, else its first keyword."""
    if len(args) > skip:
        return args[skip]
    return next(iter(kwargs.values()), None)


def _loss(out: object) -> torch.Tensor:
    """The loss inside a function's return, to run backward from."""
    loss = out
    if isinstance(out, Mapping):
        loss = out.get("loss")
    elif isinstance(out, (tuple, list)) and out:
        loss = out[0]
    elif not isinstance(out, torch.Tensor):
        loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
        return loss
    raise TypeError(
        "count_flops(fn) runs backward from the loss fn returns: a one-element tensor that "
        "requires grad, (loss, ...), {'loss': loss, ...} or an object with .loss; got "
        f"{describe(out)}. Return the loss from fn (e.g. lambda x, y: "
        "F.cross_entropy(model(x), y)), or pass a function decorated with autocast_step."
    )


def _grad_leaves(obj: object, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """The tensors in a batch (dicts, lists, tuples) whose ``.grad`` a backward sets."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad and obj.is_leaf and not isinstance(obj, nn.Parameter):
            out.append(obj)
    elif depth < 8 and isinstance(obj, Mapping):
        for value in obj.values():
            _grad_leaves(value, out, depth + 1)
    elif depth < 8 and isinstance(obj, (list, tuple)):
        for value in obj:
            _grad_leaves(value, out, depth + 1)
    return out


def count_flops(
    fn: Callable[..., Any],
    /,
    *args: Any,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Iterable[Any] = (),
    **kwargs: Any,
) -> FlopCount:
    """Count the FLOPs of one forward and backward of ``fn(*args, **kwargs)``, leaving no trace.

    >>> import torch
    >>> import torch.nn.functional as F
    >>> from cudakit.speed import count_flops
    >>> model = torch.nn.Linear(64, 32)
    >>> x, y = torch.randn(8, 64), torch.randn(8, 32)
    >>> w = model.weight.clone()
    >>> count = count_flops(lambda x, y: F.mse_loss(model(x), y), x, y, model=model)
    >>> # no grad for x
    >>> count.forward == 2 * 8 * 64 * 32, count.total == 2 * count.forward
    (True, True)
    >>> torch.equal(model.weight, w), model.weight.grad is None
    (True, True)

    ``fn`` returns the loss (or ``(loss, ...)``, ``{"loss": loss}``, an object with
    ``.loss``), and backward runs from it; a function decorated with
    ``autocast_step`` runs its own backward (and maybe an optimizer step) and is
    counted whole, its step, optimizers and schedulers put back too. The count runs
    once, under ``FlopCounterMode``; afterwards :class:`~cudakit.warmup.preserve_state`
    has put back the model's weights, gradients and buffers (BatchNorm statistics),
    ``optimizer``'s state, ``extra``'s ``state_dict()``, the global RNGs (torch, CUDA,
    ``random``, NumPy), and the ``.grad`` of a batch that requires grad. A
    ``torch.Generator`` of your own that ``fn`` draws from goes in ``extra``. An optimizer
    step adds no FLOPs to the count (it counts matmuls, convolutions and attention;
    causal attention counts as full attention, as in torch's own formulas).

    Args:
        fn: the function that computes the loss of one batch.
        *args: its arguments; the first is the example batch (``FlopCount.example``).
        model: the module ``fn`` runs (default: the ``autocast_step``'s ``model=``).
        optimizer: an optimizer ``fn`` steps, put back too.
        extra: further objects ``fn`` changes: a scheduler (by ``state_dict()``), a
            tensor, a ``torch.Generator``.
        **kwargs: keyword arguments of ``fn``.

    Returns:
        The count as a ``FlopCount`` (``int()`` of it is the total).

    Raises:
        TypeError: ``fn`` is not callable, a wrong kind of ``model``, ``optimizer`` or
            ``extra``, or ``fn`` returned no loss to run backward from.
        ValueError: no model to put back (neither ``model=`` nor the step's).

    .. versionadded:: 0.1
    """
    check_callable(
        "count_flops",
        "fn",
        fn,
        expected="a function that computes the loss of one batch",
        fix="For example: count_flops(lambda x, y: F.cross_entropy(model(x), y), x, y, "
        "model=model).",
    )
    check_optional(
        check_type,
        "count_flops",
        "model",
        model,
        types=nn.Module,
        expected="a torch.nn.Module or None",
        fix="Pass the module fn runs (not its state_dict or parameters()).",
    )
    check_optional(
        check_type,
        "count_flops",
        "optimizer",
        optimizer,
        types=torch.optim.Optimizer,
        expected="a torch.optim.Optimizer or None",
        fix="Pass the optimizer object; put schedulers in extra=(...).",
    )
    keep = check_extra("count_flops", extra)
    step = getattr(fn, "autocast_step", None)
    step = step if isinstance(step, AutocastStep) else None
    if model is None and step is not None:
        model = step.model
    if model is None:
        raise ValueError(
            "count_flops() needs the model fn runs, to put back its weights, gradients and "
            "buffers after the counted pass: pass model=model (or build the autocast_step "
            "with model=model)."
        )
    optimizers: tuple[torch.optim.Optimizer, ...] = ()
    if step is not None:
        keep = (*keep, step, *step.schedulers)
        optimizers = tuple(o for o in step.optimizers if o is not optimizer)
    # A batch that requires grad gets its .grad from the counted backward: put back too.
    keep = (*keep, *_grad_leaves((args, kwargs), []))
    with contextlib.ExitStack() as stack:
        stack.enter_context(preserve_state(model, optimizer, extra=keep))
        for opt in optimizers:  # the step's other optimizers: their parameters and state
            stack.enter_context(preserve_state(None, opt))
        formulas = Formulas()
        with FlopCounterMode(display=False, custom_mapping=formulas.mapping()) as counter:
            out = fn(*args, **kwargs)
            forward: int | None = int(counter.get_total_flops())
            if isinstance(out, StepResult):
                forward = None  # its backward already ran, inside the step
            else:
                _loss(out).backward()
            total = int(counter.get_total_flops())
        del out
    example = batch_of(args, kwargs, batch_position(fn))
    return FlopCount(total, forward, example, recomputed=formulas.recomputed)
