"""The accumulation window: its position, its losses and weights, and gradient sync.

A window is ``accumulate`` micro-steps whose gradients are summed before one
optimizer step. :class:`Window` counts them and keeps what the step needs at the
end: the micro-batch losses (for the non-finite guard) and, for token-weighted
losses, the running sum of the weights, on the device (no host sync).

:class:`GradSync` turns gradient communication off for micro-steps that do not
step: ``no_sync()`` on DDP, ``set_requires_gradient_sync(False)`` on FSDP2 modules,
and brings a partial window's gradients in line across ranks for ``flush()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from .._dist import group_world_size

__all__ = ["GradSync", "Window"]


class Window:
    """Position and contents of the current accumulation window."""

    __slots__ = (
        "accumulate",
        "cleared",
        "last_loss",
        "losses",
        "position",
        "scale",
        "unsynced",
        "weight",
        "weighted",
    )

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.position = 0  # micro-steps taken in the current window
        self.losses: list[torch.Tensor] = []  # detached, for the guard
        self.weight: torch.Tensor | None = None  # running sum of token weights (device)
        self.weighted: bool | None = None  # whether this window's losses carry weights
        self.unsynced = False  # a micro-step of this window ran without gradient sync
        self.cleared = False  # the step's gradients were cleared for this window
        self.scale: torch.Tensor | None = None  # the loss scale this window's losses used
        self.last_loss: torch.Tensor | None = None  # the last micro-batch's loss, detached

    @property
    def opening(self) -> bool:
        """True before the first micro-step of a window."""
        return self.position == 0

    def closes_next(self) -> bool:
        """True when the next micro-step fills the window (and so steps)."""
        return self.position + 1 >= self.accumulate

    def add_weight(self, weight: torch.Tensor) -> None:
        """Add a micro-batch's weight to the window's total (on the device)."""
        self.weight = weight if self.weight is None else self.weight + weight

    def clear(self) -> None:
        """Close the window: position 0, nothing kept."""
        self.position = 0
        self.losses.clear()
        self.weight = None
        self.weighted = None
        self.unsynced = False
        self.cleared = False
        self.scale = None
        self.last_loss = None


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
            dist = torch.distributed
            group = getattr(self.model, "process_group", None)
            world = dist.get_world_size(group)
            for g in grads():
                dist.all_reduce(g, group=group)
                g.div_(world)
        elif self.kind == "fsdp":
            _fsdp_reduce_pending(self.model)


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
