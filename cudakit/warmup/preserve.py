"""Leave no trace: :class:`preserve_state` saves what a training step changes and restores it."""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

import torch
from torch import nn

from .._check import check_extra
from .._contextlib import ContextDecorator
from ._args import check_model, check_optimizer

__all__ = ["ExactRestore", "RngState", "preserve_state"]


@runtime_checkable
class ExactRestore(Protocol):
    """An ``extra`` that :class:`preserve_state` puts back with more than ``load_state_dict``.

    ``load_state_dict`` restores what a resume needs; an object that must come back
    exactly as it was (an ``AutocastStep`` also puts back its ``accumulate``) defines
    ``_cudakit_restore(state)``, which :meth:`preserve_state.restore` calls instead with
    the ``state_dict()`` saved on entry.

    .. versionadded:: 0.1
    """

    def _cudakit_restore(self, state: Mapping[str, Any]) -> None:
        """Put the object back exactly as ``state`` (its own ``state_dict()``) was saved."""


def _clone_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def _restore_value(original: Any, saved: Any) -> Any:
    """Put ``saved`` back into ``original`` in place when it is a tensor; return the object."""
    if isinstance(original, torch.Tensor) and isinstance(saved, torch.Tensor):
        if (original.shape, original.dtype, original.device) == (
            saved.shape,
            saved.dtype,
            saved.device,
        ):
            original.copy_(saved)
        else:
            original.data = saved
        return original
    return saved


def _restore_dict(target: dict[Any, Any], saved: dict[Any, Any]) -> None:
    """Make ``target`` hold exactly the items of ``saved`` (same objects), in place."""
    for key in [k for k in target if k not in saved]:
        del target[key]
    for key, value in saved.items():
        if key not in target or target[key] is not value:
            target[key] = value


def _grad(t: torch.Tensor) -> torch.Tensor | None:
    """``t.grad``, without the warning a non-leaf tensor gives (it has none to keep)."""
    return t.grad if t.is_leaf or t.retains_grad else None


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


class RngState:
    """The global random number generators (CPU, CUDA, ``random``, NumPy) and any extra
    ``torch.Generator`` objects, saved so that :meth:`restore` puts them back."""

    def __init__(self, generators: tuple[torch.Generator, ...] = ()) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.py = random.getstate()
        np = sys.modules.get("numpy")
        self.np = np.random.get_state() if np is not None else None
        self.generators = [(g, g.get_state()) for g in generators]

    def restore(self) -> None:
        """Put every generator back as it was when this object was made."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        elif torch.cuda.is_initialized():
            # CUDA started meanwhile: reset its generators to their fresh state.
            torch.cuda.manual_seed_all(torch.cuda.initial_seed())
        random.setstate(self.py)
        np = sys.modules.get("numpy")
        if np is not None and self.np is not None:
            np.random.set_state(self.np)
        for g, state in self.generators:
            g.set_state(state)


class _Snapshot:
    """Everything a training step can change, saved so it can be put back bit for bit."""

    def __init__(
        self,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        extra: tuple[Any, ...],
    ) -> None:
        modules = list(model.modules()) if model is not None else []
        generators = tuple(o for o in extra if isinstance(o, torch.Generator))
        loose = [o for o in extra if isinstance(o, torch.Tensor)]
        extra = tuple(o for o in extra if not isinstance(o, (torch.Tensor, torch.Generator)))
        with torch.no_grad():
            # Attribute dicts (shallow: which object sits under which name, `training` too),
            # and the parameter, buffer and submodule slots of every submodule.
            self.modules = [
                (m, dict(vars(m)), [(d, dict(d)) for d in (m._parameters, m._buffers, m._modules)])
                for m in modules
            ]
            seen: set[int] = set()
            tensors: list[torch.Tensor] = []

            def add(t: torch.Tensor | None) -> None:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    tensors.append(t)

            for m in modules:
                for param in m._parameters.values():
                    add(param)
                for buf in m._buffers.values():
                    add(buf)
            if optimizer is not None:
                for group in optimizer.param_groups:
                    for t in group["params"]:
                        add(t)
            for t in loose:
                add(t)
            self.tensors = [
                (t, t.detach().clone(), t.requires_grad, grad, _clone(grad))
                for t in tensors
                for grad in (_grad(t),)
            ]
            self.optimizer = optimizer
            if optimizer is not None:
                # vars() holds the `state` and `param_groups` objects themselves.
                self.opt_vars = dict(vars(optimizer))
                self.opt_state = {
                    p: (s, {k: (v, _clone_value(v)) for k, v in s.items()})
                    for p, s in optimizer.state.items()
                }
                self.opt_groups = [
                    (
                        g,
                        g["params"],
                        list(g["params"]),
                        {k: (v, _clone_value(v)) for k, v in g.items() if k != "params"},
                    )
                    for g in optimizer.param_groups
                ]
            self.extra = [(obj, copy.deepcopy(obj.state_dict())) for obj in extra]
        self.rng = RngState(generators)

    def restore(self) -> BaseException | None:
        """Put everything back; the first error an extra's restore raised, if any."""
        with torch.no_grad():
            # Extras first: their load_state_dict() may set tensors (AutocastStep rebinds
            # .grad mid-window) that the exact restore below must have the last word on.
            failed: BaseException | None = None
            for obj, state in self.extra:
                # An AutocastStep puts its accumulate back too (a resume would not).
                load = (
                    obj._cudakit_restore if isinstance(obj, ExactRestore) else obj.load_state_dict
                )
                try:
                    load(state)
                except BaseException as exc:  # restore the rest, then raise the first
                    failed = failed or exc
            for m, attrs, slots in self.modules:
                _restore_dict(vars(m), attrs)
                for target, saved_slots in slots:
                    _restore_dict(target, saved_slots)
            for t, data, requires_grad, grad, grad_data in self.tensors:
                _restore_value(t, data)
                if t.requires_grad != requires_grad:
                    t.requires_grad_(requires_grad)
                if grad is not None and grad_data is not None:
                    _restore_value(grad, grad_data)
                if _grad(t) is not grad:
                    t.grad = grad
            opt = self.optimizer
            if opt is not None:
                _restore_dict(vars(opt), self.opt_vars)
                _restore_dict(opt.state, {p: s for p, (s, _) in self.opt_state.items()})
                for s, items in self.opt_state.values():
                    _restore_dict(s, {k: _restore_value(v, c) for k, (v, c) in items.items()})
                opt.param_groups[:] = [g for g, *_ in self.opt_groups]
                for g, params_obj, group_params, items in self.opt_groups:
                    params_obj[:] = group_params
                    saved: dict[str, Any] = {k: _restore_value(v, c) for k, (v, c) in items.items()}
                    saved["params"] = params_obj
                    _restore_dict(g, saved)
        self.rng.restore()
        return failed


class preserve_state(ContextDecorator):
    """Put a model, its optimizer and the random number generators back exactly as they were.

    On exit, normal or by any exception (``KeyboardInterrupt`` included), restores bit
    for bit: parameters and buffers (BatchNorm running statistics and
    ``num_batches_tracked`` too), ``.grad`` (its ``None``-ness, the very tensor object,
    and its values), ``requires_grad`` flags, every submodule's ``training`` mode and
    other attributes, the optimizer's state and ``param_groups`` (tensors restored in
    place), ``state_dict()`` of every object in ``extra`` (schedulers, GradScalers,
    :class:`~cudakit.amp.AutocastStep`), and the CPU, CUDA, ``random`` and NumPy RNG
    states. ``extra`` also takes tensors (a batch that requires grad: its values,
    ``requires_grad`` and ``.grad``) and your own ``torch.Generator`` objects. Tensors
    are cloned on their own device and copied back with ``copy_``, so the block needs
    spare memory the size of that state.

    >>> import torch
    >>> from cudakit.warmup import preserve_state
    >>> model = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> w = model.weight.clone()
    >>> with preserve_state(model, opt):
    ...     model(torch.ones(1, 2)).sum().backward()
    ...     opt.step()
    >>> torch.equal(model.weight, w), model.weight.grad is None
    (True, True)

    Args:
        model: The module to preserve, or ``None``.
        optimizer: Its optimizer, or ``None``; its parameters are preserved too.
        extra: Further objects with ``state_dict()``/``load_state_dict()``, tensors
            and ``torch.Generator`` objects.

    Raises:
        TypeError: ``model`` is not a module, ``optimizer`` not an optimizer, or an
            ``extra`` object is none of those (or is a class).
        ValueError: the model still has uninitialized lazy parameters.
        RuntimeError: ``__exit__`` without a matching ``__enter__``.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        extra: Iterable[Any] = (),
    ) -> None:
        self.model = check_model(model, "preserve_state")
        self.optimizer = check_optimizer(optimizer, "preserve_state")
        self.extra = check_extra("preserve_state", extra)
        self._snapshots: list[_Snapshot] = []

    def clone(self) -> Self:
        """Return a fresh, un-entered copy guarding the same objects."""
        return type(self)(self.model, self.optimizer, extra=self.extra)

    def __enter__(self) -> Self:
        self._snapshots.append(_Snapshot(self.model, self.optimizer, self.extra))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._snapshots:
            raise RuntimeError(
                "preserve_state.__exit__() was called without __enter__(): nothing was saved, "
                "so nothing can be put back. Use `with preserve_state(model, optimizer):` or "
                "decorate the function with @preserve_state(model, optimizer)."
            )
        failed = self._snapshots.pop().restore()
        if failed is None:
            return
        if exc is None:
            raise failed
        # The block's own exception (a Ctrl-C, say) goes on; the restore's is noted on it.
        exc.add_note(
            f"preserve_state(): restoring an extra object also failed: {failed!r}; "
            "everything else was put back."
        )
