"""The door of :class:`~cudakit.checkpoint.Checkpointer`: every argument checked first.

What the step already knows is taken from it: ``step=`` alone gives the model
(``autocast_step(model=...)``), the optimizers and the schedulers.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._check import check_bool, check_int, check_optional, fail_type, fail_value
from ..amp import AutocastStep
from ._preemption import stop_signals
from ._state import Parts, assign_owners, check_extras

__all__ = [
    "Options",
    "batches_loader",
    "check_loader",
    "check_safe_globals",
    "describe_parts",
    "resolve",
    "resolve_directory",
]

_FUNC = "Checkpointer"


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything :class:`Checkpointer` was asked to do, checked."""

    root: Path
    parts: Parts
    loader: Any
    keep: int | None
    every: int | None
    background: bool
    preemption: tuple[signal.Signals, ...]
    exit_code: int | None
    requeue: bool | str
    #: The user's types torch's safe loader admits in this run's checkpoints.
    safe_globals: tuple[Any, ...] = ()
    #: Read checkpoints with pickle's full loader (older checkpoints need it).
    trust_pickles: bool = False


def _steps(value: object) -> tuple[AutocastStep, ...]:
    if value is None:
        return ()
    items = list(value) if isinstance(value, list | tuple) else [value]
    steps: list[AutocastStep] = []
    for item in items:
        step = getattr(item, "autocast_step", item)
        if not isinstance(step, AutocastStep):
            fail_type(
                _FUNC,
                "step",
                "an autocast_step (the object, or the function it decorated), or a list",
                item,
                "Pass step=train_step, where train_step is decorated with "
                "@cudakit.autocast_step(...).",
            )
        if any(step is s for s in steps):
            fail_value(_FUNC, "step", "each step once", item, "Remove the duplicate.")
        steps.append(step)
    return tuple(steps)


def _models(value: object, steps: tuple[AutocastStep, ...]) -> dict[str, nn.Module]:
    if value is None:
        found = [s.model for s in steps if s.model is not None]
        if not found:
            fail_type(
                _FUNC,
                "model",
                "an nn.Module (or a dict of names to modules)",
                value,
                "Pass model=model, or build the step with autocast_step(..., model=model).",
            )
        unique: list[nn.Module] = []
        for m in found:
            if all(m is not u for u in unique):
                unique.append(m)
        if len(unique) == 1:
            return {"model": unique[0]}
        return {f"model{i}": m for i, m in enumerate(unique)}
    if isinstance(value, nn.Module):
        return {"model": value}
    if isinstance(value, Mapping) and value:
        for key, module in value.items():
            if not isinstance(key, str) or not key or "." in key:
                fail_value(
                    _FUNC,
                    "model",
                    "a dict whose keys are names without dots",
                    key,
                    "Name each model, e.g. model={'generator': g, 'discriminator': d}.",
                )
            if not isinstance(module, nn.Module):
                fail_type(_FUNC, f"model[{key!r}]", "an nn.Module", module)
        return dict(value)
    return fail_type(
        _FUNC,
        "model",
        "an nn.Module or a non-empty dict of names to modules",
        value,
        "Pass model=model, or name several: model={'generator': g, 'discriminator': d}.",
    )


def _sequence(value: object) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    return [value]


def _optimizers(
    value: object, steps: tuple[AutocastStep, ...]
) -> tuple[torch.optim.Optimizer, ...]:
    items = _sequence(value) if value is not None else [o for s in steps for o in s.optimizers]
    out: list[torch.optim.Optimizer] = []
    for item in items:
        if not isinstance(item, torch.optim.Optimizer):
            fail_type(
                _FUNC,
                "optimizer",
                "a torch.optim.Optimizer (or a list of them)",
                item,
                "Pass optimizer=optimizer, or a list: optimizer=[opt_g, opt_d].",
            )
        if all(item is not o for o in out):
            out.append(item)
    return tuple(out)


def _schedulers(value: object, steps: tuple[AutocastStep, ...]) -> tuple[Any, ...]:
    items = _sequence(value) if value is not None else [x for s in steps for x in s.schedulers]
    out: list[Any] = []
    for item in items:
        if isinstance(item, type) or not (
            callable(getattr(item, "state_dict", None))
            and callable(getattr(item, "load_state_dict", None))
        ):
            fail_type(
                _FUNC,
                "scheduler",
                "a learning-rate scheduler instance (with state_dict/load_state_dict)",
                item,
                "Pass the scheduler you step, e.g. scheduler=StepLR(optimizer, step_size=10).",
            )
        if all(item is not s for s in out):
            out.append(item)
    return tuple(out)


def batches_loader(value: object, default: Any) -> Any:
    """The loader ``Checkpointer.batches(loader)`` iterates: ``value``, else ``default``.

    Checked when ``batches()`` is called, not at its first ``next()``.
    """
    if value is not None:
        return check_loader("Checkpointer.batches", value)
    if default is None:
        fail_type(
            "Checkpointer.batches",
            "loader",
            "a DataLoader (here or as Checkpointer(loader=...))",
            value,
            "Pass the loader to the Checkpointer so that its position is saved.",
        )
    return default


def check_loader(func: str, value: object) -> Any:
    """``value`` if it is a re-iterable loader (or None)."""
    if value is None:
        return None
    if isinstance(value, Iterator):
        fail_type(
            func,
            "loader",
            "a re-iterable loader (a DataLoader, a distributed_loader, a prefetch())",
            value,
            "An iterator cannot be started again at an epoch or skipped to a batch: pass the "
            "DataLoader itself.",
        )
    if isinstance(value, str | bytes | os.PathLike):
        fail_type(
            func,
            "loader",
            "a DataLoader or another re-iterable of batches",
            value,
            "A path is not a loader (it would iterate character by character): build a "
            "Dataset that reads the files there and pass DataLoader(dataset, batch_size=...).",
        )
    if not isinstance(value, Iterable):
        fail_type(
            func,
            "loader",
            "a DataLoader or another re-iterable of batches",
            value,
            "Pass the DataLoader itself, e.g. loader=DataLoader(dataset, batch_size=32).",
        )
    return value


def check_safe_globals(value: object) -> tuple[Any, ...]:
    """``safe_globals=``: None, or a list of classes and functions (or ``(obj, "name")``
    pairs, as ``torch.serialization.safe_globals`` takes them)."""
    if value is None:
        return ()
    fix = (
        "Pass the classes (or functions) your extras' values hold, e.g. "
        "safe_globals=[MyConfig]; each is then trusted as the safe loader's own types are."
    )
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        fail_type(_FUNC, "safe_globals", "a list of classes or functions", value, fix)
    for i, item in enumerate(value):
        named = (
            isinstance(item, tuple)
            and len(item) == 2
            and callable(item[0])
            and isinstance(item[1], str)
        )
        if not (named or (callable(item) and hasattr(item, "__qualname__"))):
            fail_type(
                _FUNC,
                "safe_globals",
                "a list of classes or functions (or (obj, 'module.name') pairs)",
                value,
                f"Item {i} is {type(item).__name__} {item!r:.40}: pass the class itself, not "
                f"an instance or its name. {fix}",
            )
    return tuple(value)


def resolve_directory(func: str, value: object) -> Path:
    """``value`` as a ``Path`` if it is a non-empty str or ``os.PathLike``."""
    arg = "directory" if "." not in func else "path"
    if isinstance(value, bytes) or not isinstance(value, str | os.PathLike):
        fail_type(
            func, arg, "a path (str or os.PathLike)", value, f"Pass e.g. {arg}='checkpoints/run1'."
        )
    if os.fspath(value) == "":
        fail_value(func, arg, "a non-empty path", value, "Pass e.g. 'checkpoints/run1'.")
    return Path(os.fspath(value))


def resolve(
    directory: object,
    *,
    model: object,
    optimizer: object,
    step: object,
    scheduler: object,
    loader: object,
    extra: object,
    keep: object,
    every: object,
    async_save: object,
    preemption: object,
    exit_code: object,
    requeue: object,
    safe_globals: object = None,
    trust_pickles: object = False,
) -> Options:
    """Check every argument of :class:`Checkpointer`; nothing is touched on a refusal."""
    root = resolve_directory(_FUNC, directory)
    steps = _steps(step)
    models = _models(model, steps)
    optimizers = _optimizers(optimizer, steps)
    owners = assign_owners(_FUNC, models, optimizers)
    schedulers = _schedulers(scheduler, steps)
    extras = check_extras(_FUNC, extra)
    keep_n = check_optional(check_int, _FUNC, "keep", keep, minimum=1)
    every_n = check_optional(check_int, _FUNC, "every", every, minimum=1)
    background = check_bool(_FUNC, "async_save", async_save)
    watch = stop_signals(_FUNC, preemption)
    code = check_optional(check_int, _FUNC, "exit_code", exit_code, minimum=0, maximum=255)
    if requeue != "auto" and not isinstance(requeue, bool):
        fail_type(
            _FUNC,
            "requeue",
            "'auto', True or False",
            requeue,
            "'auto' requeues a SLURM job after a stop signal other than SIGTERM "
            "(SIGUSR1, its --signal, by default); pass requeue=False to never requeue, or "
            "leave it out.",
        )
    allowed = check_safe_globals(safe_globals)
    trust = check_bool(
        _FUNC,
        "trust_pickles",
        trust_pickles,
        fix="Pass trust_pickles=True only for checkpoints you wrote, or leave it out.",
    )
    return Options(
        root=root,
        parts=Parts(models, optimizers, owners, schedulers, steps, extras),
        loader=check_loader(_FUNC, loader),
        keep=keep_n,
        every=every_n,
        background=background,
        preemption=watch,
        exit_code=code,
        requeue=requeue,
        safe_globals=allowed,
        trust_pickles=trust,
    )


def describe_parts(parts: Parts) -> str:
    """``2 models, 2 optimizers, 1 scheduler`` for a message."""
    return (
        f"{len(parts.models)} model(s) {sorted(parts.models)}, {len(parts.optimizers)} "
        f"optimizer(s), {len(parts.schedulers)} scheduler(s), {len(parts.steps)} step(s)"
    )
