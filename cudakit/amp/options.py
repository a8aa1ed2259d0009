"""Argument checks of :func:`~cudakit.amp.autocast_step` that are particular to it:
optimizers and schedulers (one or a list), the device type of their parameters, and
``compile=``. Plain kinds and ranges go through :mod:`cudakit._check`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["check_compile", "check_optimizers", "check_schedulers", "compile_fn", "device_type_of"]


def _as_tuple(value: object) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def check_optimizers(optimizer: object) -> tuple[torch.optim.Optimizer, ...]:
    optimizers = _as_tuple(optimizer)
    if not optimizers:
        raise ValueError(
            f"autocast_step() got an empty {type(optimizer).__name__} of optimizers; pass "
            "one optimizer, or a list such as [opt_matrices, opt_embeddings]."
        )
    for opt in optimizers:
        if isinstance(opt, torch.optim.Optimizer):
            continue
        hint = ""
        if callable(opt) and not isinstance(opt, torch.nn.Module):
            hint = (
                " It looks like @autocast_step was used without arguments; write "
                "@autocast_step(optimizer, ...) above the function."
            )
        elif isinstance(opt, torch.nn.Module):
            hint = " Pass the optimizer first, and the model as model=... (for DDP no_sync)."
        raise TypeError(
            "autocast_step() expects a torch.optim.Optimizer (or a list of them) as its first "
            f"argument, got {type(opt).__name__}.{hint}"
        )
    if len({id(o) for o in optimizers}) != len(optimizers):
        raise ValueError(
            "autocast_step() got the same optimizer twice in its list; each optimizer "
            "steps once per step, so list each one once."
        )
    return optimizers


def check_schedulers(
    scheduler: object, optimizers: Sequence[torch.optim.Optimizer]
) -> tuple[Any, ...]:
    if scheduler is None:
        return ()
    schedulers = _as_tuple(scheduler)
    for s in schedulers:
        if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                "autocast_step(scheduler=ReduceLROnPlateau) cannot work: it steps on a "
                "validation metric, not once per optimizer step. Leave it out and call "
                "scheduler.step(val_loss) after each validation."
            )
        if not callable(getattr(s, "step", None)):
            raise TypeError(
                "autocast_step(scheduler=...) expects a learning-rate scheduler with a "
                f"step() method (or a list of them), got {type(s).__name__}."
            )
        owner = getattr(s, "optimizer", None)
        if isinstance(owner, torch.optim.Optimizer) and all(owner is not o for o in optimizers):
            raise ValueError(
                f"autocast_step(scheduler=...) got a {type(s).__name__} of an optimizer this "
                "step does not step; pass that optimizer too (autocast_step([opt_a, opt_b], "
                "scheduler=[sched_a, sched_b])), or drive that scheduler yourself."
            )
    return schedulers


def device_type_of(params: Sequence[torch.Tensor]) -> str:
    types = {p.device.type for p in params}
    if not types:
        raise ValueError(
            "autocast_step() got an optimizer with no parameters, so there is nothing to "
            "train. Build it from the model's parameters, e.g. "
            "torch.optim.AdamW(model.parameters()), before wrapping it."
        )
    if len(types) == 1:
        return types.pop()
    return sorted(types - {"cpu"})[0]


_COMPILE_OPTIONS = frozenset({"fullgraph", "dynamic", "backend", "mode", "options", "disable"})


def check_compile(value: object) -> dict[str, Any] | None:
    """``compile=``: False, True (torch.compile's defaults) or a mapping of its options."""
    if value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - _COMPILE_OPTIONS)
        if unknown:
            raise ValueError(
                f"autocast_step(compile=...) got options torch.compile does not take: "
                f"{unknown}; expected some of {sorted(_COMPILE_OPTIONS)}, e.g. "
                "compile={'mode': 'max-autotune'}."
            )
        return dict(value)
    raise TypeError(
        f"autocast_step(compile=...) expects True, False or a dict of torch.compile options, "
        f"got {type(value).__name__} {value!r}. For example: compile=True or "
        "compile={'mode': 'reduce-overhead'}."
    )


def compile_fn(
    fn: Callable[..., Any], options: Mapping[str, Any], **forced: Any
) -> Callable[..., Any]:
    return torch.compile(fn, **{**options, **forced})
