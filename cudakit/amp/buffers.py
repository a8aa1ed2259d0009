"""The model's buffers as they were when a window opened, for a skipped step.

BatchNorm's running statistics change in the forward pass, before the step knows
whether the window's loss or gradients are finite. :class:`BufferSnapshot` copies
them when a window opens and puts them back when its step is skipped, so a NaN batch
cannot poison them: with a host verdict (:meth:`restore`) or on the device
(:meth:`restore_where`).
"""

from __future__ import annotations

import torch

__all__ = ["BufferSnapshot"]


class BufferSnapshot:
    """Copies of a module's buffers, taken once per window, reused between windows."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._buffers: list[torch.Tensor] = []
        self._copies: list[torch.Tensor] = []
        #: True between :meth:`save` and the end of the window (:meth:`forget`).
        self.saved = False

    def save(self) -> None:
        """Copy the buffers now (the window opens); the copies' memory is reused."""
        bufs = [b for b in self._module.buffers() if b is not None]
        if len(bufs) != len(self._buffers) or any(
            a is not b for a, b in zip(bufs, self._buffers, strict=True)
        ):
            self._buffers = bufs
            self._copies = [torch.empty_like(b) for b in bufs]
        if bufs:
            torch._foreach_copy_(self._copies, bufs)
        self.saved = True

    def restore(self) -> None:
        """Put the saved buffers back (the window's step was skipped)."""
        if self.saved and self._buffers:
            with torch.no_grad():
                torch._foreach_copy_(self._buffers, self._copies)

    def restore_where(self, skip: torch.Tensor) -> None:
        """Put the saved buffers back where the 0-dim bool ``skip`` is true, on the device."""
        if self.saved and self._buffers:
            with torch.no_grad():
                for buf, saved in zip(self._buffers, self._copies, strict=True):
                    buf.copy_(torch.where(skip, saved, buf))

    def copies(self) -> list[torch.Tensor] | None:
        """The saved copies (cloned), for a checkpoint taken mid-window; None if unsaved."""
        return [c.clone() for c in self._copies] if self.saved else None

    def check(self, copies: object) -> list[torch.Tensor]:
        """``copies`` from a checkpoint, checked against this module's buffers."""
        bufs = [b for b in self._module.buffers() if b is not None]
        if not isinstance(copies, (list, tuple)) or len(copies) != len(bufs):
            raise ValueError(
                "AutocastStep.load_state_dict(): state['window_buffers'] must hold one "
                f"tensor per buffer of the model ({len(bufs)}), got {type(copies).__name__}. "
                "Pass the dict returned by AutocastStep.state_dict() for the same model."
            )
        for c, b in zip(copies, bufs, strict=True):
            if not isinstance(c, torch.Tensor) or c.shape != b.shape:
                raise ValueError(
                    "AutocastStep.load_state_dict(): a tensor of state['window_buffers'] "
                    f"does not match its buffer of shape {tuple(b.shape)}; resume with the "
                    "same model."
                )
        return list(copies)

    def load(self, copies: list[torch.Tensor]) -> None:
        """Take checked ``copies`` as the snapshot of the open window."""
        self._buffers = [b for b in self._module.buffers() if b is not None]
        self._copies = [
            c.detach().to(device=b.device, dtype=b.dtype, copy=True)
            for c, b in zip(copies, self._buffers, strict=True)
        ]
        self.saved = True

    def forget(self) -> None:
        """The window closed: the next window saves again."""
        self.saved = False
