"""The accumulation window: its position, its losses and weights, and gradient sync.

A window is ``accumulate`` micro-steps whose gradients are summed before one
optimizer step. :class:`Window` counts them and keeps what the step needs at the
end: the micro-batch losses (for the non-finite guard) and, for token-weighted
losses, the running sum of the weights, on the device (no host sync). Its life is
one :class:`Stage` (as ``GradScaler`` keeps an optimizer's in one ``OptState``):
closed, open (the step's gradients cleared), or open with unsynced micro-steps.

Between micro-steps it remembers one of the window's gradient tensors per optimizer,
so a ``zero_grad()`` left in the loop is noticed. :func:`backward_in_window` runs a
micro-step's backward so that a failure (an exception, Ctrl-C) leaves the window as
it was before: after the first micro-step, the window's gradients are set aside
(``.grad`` set to None, no copy), the micro-step's own land in ``.grad``, and after
a good backward they are added in place, as autograd would have (same order, same
bits); after a failed one the window's are put back. The cost: one micro-step's
gradients are held beside the window's until its backward ends.

:class:`GradSync` turns gradient communication off for micro-steps that do not
step: ``no_sync()`` on DDP, ``set_requires_gradient_sync(False)`` on FSDP2 modules,
and brings a partial window's gradients in line across ranks for ``flush()``.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, cast

import torch

from .._dist import group_world_size
from . import _misuse as misuse

__all__ = ["GradSync", "Stage", "Window", "backward_in_window", "ddp_comm_hook", "reached_any"]

_STRIDED = torch.strided


class Stage(enum.Enum):
    """Where an accumulation window is in its life.

    ``CLOSED`` -> ``OPEN`` when a micro-step clears the step's gradients (where a
    hand-written loop calls ``zero_grad()``); ``OPEN`` -> ``UNSYNCED`` when a
    micro-step's backward runs without gradient sync (``flush()`` then syncs the
    window); back to ``CLOSED`` when the window steps, skips or is dropped.
    """

    CLOSED = "closed"
    OPEN = "open"
    UNSYNCED = "unsynced"


class Window:
    """Position and contents of the current accumulation window."""

    __slots__ = (
        "accumulate",
        "backwarded",
        "ends",
        "last_loss",
        "losses",
        "position",
        "recorded",
        "scale",
        "stage",
        "total",
        "weight",
        "weighted",
    )

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.position = 0  # micro-steps taken in the current window
        self.losses: list[torch.Tensor] = []  # detached, for the guard
        self.weight: torch.Tensor | None = None  # running sum of token weights (device)
        self.weighted: bool | None = None  # whether this window's losses carry weights
        # The total weight over all ranks, once the closing window has summed it.
        self.total: torch.Tensor | None = None
        self.stage = Stage.CLOSED
        self.scale: torch.Tensor | None = None  # the loss scale this window's losses used
        self.last_loss: torch.Tensor | None = None  # the last micro-batch's loss, detached
        # (parameter, its gradient tensor) after the window's last micro-step, one per
        # optimizer: a zero_grad() between micro-steps takes them away.
        self.recorded: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # The loss tensor of the last good backward (any window), to refuse it twice.
        self.backwarded: Callable[[], torch.Tensor | None] | None = None
        # Inside AutocastStep.last_micro_step(): the micro-steps run now end the epoch.
        self.ends = False

    @property
    def opening(self) -> bool:
        """True before the first micro-step of a window."""
        return self.position == 0

    def closes_next(self) -> bool:
        """True when the next micro-step fills the window (and so steps)."""
        return self.position + 1 >= self.accumulate

    def syncs_next(self) -> bool:
        """True when the next micro-step communicates its gradients: it fills the window,
        or it is the epoch's last (a partial window's, which ``flush()`` then steps)."""
        return self.ends or self.position + 1 >= self.accumulate

    def open(self) -> None:
        """The step's gradients were cleared for this window: it is open."""
        self.stage = Stage.OPEN

    def mark_unsynced(self) -> None:
        """A micro-step of this open window ran its backward without gradient sync."""
        self.stage = Stage.UNSYNCED

    def mark_synced(self) -> None:
        """A micro-step of this open window synced every gradient so far (DDP's, FSDP2's
        backward), without closing it: nothing is left for ``flush()`` to reduce."""
        self.stage = Stage.OPEN

    def total_weight(self) -> torch.Tensor:
        """A token-weighted window's total weight: over all ranks once summed, else its own."""
        total = self.total
        return total if total is not None else cast(torch.Tensor, self.weight)

    def add_weight(self, weight: torch.Tensor) -> None:
        """Add a micro-batch's weight to the window's total (on the device)."""
        self.weight = weight if self.weight is None else self.weight + weight

    def clear(self) -> None:
        """Close the window: position 0, nothing kept."""
        self.position = 0
        self.losses.clear()
        self.weight = None
        self.weighted = None
        self.total = None
        self.stage = Stage.CLOSED
        self.scale = None
        self.last_loss = None
        self.recorded = None

    def record(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
        """Remember a gradient per optimizer after a micro-step, when the window goes on."""
        self.recorded = [w for w in map(_witness, optimizers) if w is not None]

    def check_grads(self) -> None:
        """Raise if the window's gradients were cleared or replaced since its last micro-step
        (a ``zero_grad()`` left in the loop). One gradient per optimizer is looked at, and
        no value: zeroing in place (``set_to_none=False``) goes unseen."""
        for p, grad in self.recorded or ():
            if p.grad is not grad:
                raise misuse.grads_changed_error(self.position, self.accumulate, p.grad is None)


def _witness(opt: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first parameter of ``opt`` that has a gradient, and that gradient."""
    for group in opt.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is not None:
                return p, grad
    return None


def reached_any(optimizers: tuple[torch.optim.Optimizer, ...]) -> bool:
    """Whether any parameter of ``optimizers`` has a gradient (stops at the first)."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    return True
    return False


def _set_aside(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The window's gradients, taken out of ``.grad`` (None there now)."""
    grads = [p.grad for p in params]
    for p, g in zip(params, grads, strict=True):
        if g is not None:
            p.grad = None
    return grads


def _merge(params: list[torch.Tensor], aside: list[torch.Tensor | None]) -> None:
    """Add a good micro-step's gradients into the window's set aside, as autograd would."""
    olds: list[torch.Tensor] = []
    news: list[torch.Tensor] = []
    back: list[tuple[torch.Tensor, torch.Tensor]] = []
    for p, old in zip(params, aside, strict=True):
        if old is None:
            continue  # the micro-step's gradient (or none) is the window's now
        new = p.grad
        if new is None:
            pass
        elif old.layout is _STRIDED and new.layout is _STRIDED:
            olds.append(old)
            news.append(new)
        elif old.is_sparse and not new.is_sparse:
            old = new + old  # autograd's way for a dense gradient onto a sparse one
        else:
            old += new
        back.append((p, old))
    if olds:
        torch._foreach_add_(olds, news)
    for p, g in back:
        p.grad = g


def backward_in_window(
    loss: torch.Tensor,
    window: Window,
    sync: GradSync,
    params: list[torch.Tensor],
    drop: Callable[[], None],
    paused: bool,
) -> None:
    """``loss.backward()`` as a micro-step after a window's first; a failure changes nothing.

    The window's gradients are checked (a ``zero_grad()`` left in the loop), set aside
    during the backward and added back after it, or put back if it fails. Where they
    cannot be set aside, in a micro-step that DDP synchronises (its reducer reads the
    accumulated ``.grad``) and under FSDP2 (which keeps unsynced gradients inside
    itself), a failure drops the window (``drop``) and the exception says so.
    ``paused``: whether this micro-step runs without gradient sync.
    """
    window.check_grads()
    grads = None
    if sync.kind != "fsdp" and (paused or not sync.active):
        grads = _set_aside(params)
    try:
        loss.backward()
    except BaseException as exc:
        if grads is not None:
            for p, old in zip(params, grads, strict=True):
                p.grad = old
        else:
            note = misuse.dropped_window_note(sync.kind, window.position)
            drop()
            exc.add_note(note)
        raise
    if grads is not None:
        _merge(params, grads)


class GradSync:
    """Gradient communication for the model being trained: off on micro-steps."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        self.model = model
        self.kind: str | None = None
        self._pause: Callable[[], AbstractContextManager[Any]] | None = None
        #: True when micro-steps can skip gradient communication (a plain attribute:
        #: read on every call). With ``accumulate=1`` every micro-step closes its
        #: window, so nothing is ever paused.
        self.active = False
        if model is None:
            return
        set_sync = getattr(model, "set_requires_gradient_sync", None)
        no_sync = getattr(model, "no_sync", None)
        if callable(set_sync):
            self.kind = "fsdp"
            self._pause = self._fsdp_paused
            self.active = True
        elif callable(no_sync):
            self.kind = "ddp"
            self._pause = no_sync
            self.active = True

    def paused(self) -> AbstractContextManager[Any]:
        """A context in which backward does not communicate gradients."""
        assert self._pause is not None  # callers check .active first
        return self._pause()

    @contextlib.contextmanager
    def _fsdp_paused(self) -> Iterator[None]:
        model: Any = self.model
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def sync_partial(self, grads: Callable[[], list[torch.Tensor]]) -> None:
        """Reduce a partial window's gradients across ranks, as a synced backward would.

        DDP: all-reduce and average every gradient. FSDP2: run the reduce-scatter its
        post-backward would have run (the gradients are still unsharded).
        """
        if group_world_size() <= 1:
            return
        if self.kind == "ddp":
            hook = ddp_comm_hook(self.model)
            if hook is not None:
                raise misuse.comm_hook_flush_error(hook)
            dist = torch.distributed
            group = getattr(self.model, "process_group", None)
            world = dist.get_world_size(group)
            for g in grads():
                dist.all_reduce(g, group=group)
                g.div_(world)
        elif self.kind == "fsdp":
            _fsdp_reduce_pending(self.model)


def ddp_comm_hook(model: Any) -> str | None:
    """The name of the communication hook registered on a DDP model, or None."""
    logging_data = getattr(model, "_get_ddp_logging_data", None)
    name = logging_data().get("comm_hook") if callable(logging_data) else None
    if not name:
        hooks = getattr(model, "_comm_hooks", None) or []
        name = getattr(hooks[0][0], "__qualname__", repr(hooks[0][0])) if hooks else None
    return str(name) if name else None


def _fsdp_reduce_pending(model: Any) -> None:
    """Reduce-scatter FSDP2's accumulated unsharded gradients now (for ``flush()``)."""
    try:
        from torch.distributed.fsdp import FSDPModule

        states = []
        for module in model.modules():
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state()
                for group in reversed(state._fsdp_param_groups):
                    group.reduce_grads = True
                    group.all_reduce_grads = True
                    group.post_backward()
                states.append(state)
        for state in states:
            for group in state._fsdp_param_groups:
                group.finalize_backward()
    except (ImportError, AttributeError, TypeError) as e:  # a torch without these internals
        raise RuntimeError(
            "AutocastStep.flush(): this torch's FSDP2 does not expose the post-backward "
            f"reduction cudakit uses to finish a partial window ({e}). Make each epoch a "
            "multiple of accumulate= (e.g. DataLoader(drop_last=True)) instead of flushing."
        ) from e
