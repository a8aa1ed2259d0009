"""The model's buffers as they were when a window opened, for a skipped step.

BatchNorm's running statistics change in the forward pass, before the step knows
whether the window's loss or gradients are finite. :class:`BufferSnapshot` copies
them when a window opens and puts them back when its step is skipped, so a NaN batch
cannot poison them: with a host verdict (:meth:`restore`) or on the device
(:meth:`restore_where`).

Buffers are put back by name. A forward that re-assigns a buffer (``self.mean = ...``)
instead of updating it in place leaves a new tensor under that name; a skip puts the
tensor the window opened with back under the name, holding its saved values, so the
NaN never stays in the model.
"""

from __future__ import annotations

import torch

__all__ = ["BufferSnapshot"]


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The submodule that holds buffer ``name`` (a qualified name), and the buffer's own name."""
    prefix, _, leaf = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), leaf


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


class BufferSnapshot:
    """Copies of a module's buffers, taken once per window, reused between windows."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._names: list[str] = []  # qualified names, in named_buffers() order
        self._owners: list[tuple[torch.nn.Module, str]] = []  # (holder, own name) per name
        self._buffers: list[torch.Tensor] = []  # the tensors under those names at save()
        self._copies: list[torch.Tensor] = []
        #: True between :meth:`save` and the end of the window (:meth:`forget`).
        self.saved = False

    def _bind(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Follow the module's buffers now: names, holders, and copies to save into."""
        names = [n for n, _ in named]
        if names != self._names:
            self._owners = [_owner(self._module, n) for n in names]
        # A forward that re-assigns a buffer gives a new tensor every window: its copy
        # is reused while shape, dtype and device stay.
        old = dict(zip(self._names, self._copies, strict=True))
        self._names = names
        self._buffers = [b for _, b in named]
        copies = []
        for n, b in named:
            c = old.get(n)
            copies.append(c if c is not None and _same_kind(c, b) else torch.empty_like(b))
        self._copies = copies

    def save(self) -> None:
        """Copy the buffers now (the window opens); the copies' memory is reused."""
        named = list(self._module.named_buffers())
        if len(named) != len(self._buffers) or any(
            b is not mine for (_, b), mine in zip(named, self._buffers, strict=True)
        ):
            self._bind(named)
        if named:
            torch._foreach_copy_(self._copies, self._buffers)
        self.saved = True

    def restore(self) -> None:
        """Put the saved buffers back by name (the window's step was skipped)."""
        if not (self.saved and self._buffers):
            return
        with torch.no_grad():
            torch._foreach_copy_(self._buffers, self._copies)
        for (holder, leaf), buf in zip(self._owners, self._buffers, strict=True):
            if holder._buffers.get(leaf) is not buf:  # the forward re-assigned it
                holder._buffers[leaf] = buf

    def restore_where(self, skip: torch.Tensor) -> None:
        """Put the saved buffers back where the 0-dim bool ``skip`` is true, on the device.

        A buffer the forward re-assigned with a tensor of the same shape, dtype and
        device is blended on the device too. One re-assigned with another shape or dtype
        (or removed) cannot be: for it alone the verdict is read on the host.
        """
        if not (self.saved and self._buffers):
            return
        parts = zip(self._owners, self._buffers, self._copies, strict=True)
        with torch.no_grad():
            for (holder, leaf), buf, saved in parts:
                now = holder._buffers.get(leaf)
                if now is buf:
                    buf.copy_(torch.where(skip, saved, buf))
                    continue
                if now is not None and _same_kind(now, buf):
                    buf.copy_(torch.where(skip, saved, now))
                elif bool(skip):  # a host read, for this rare buffer only
                    buf.copy_(saved)
                else:
                    continue  # a good step keeps what the forward made
                holder._buffers[leaf] = buf

    def copies(self) -> list[torch.Tensor] | None:
        """The saved copies (cloned), for a checkpoint taken mid-window; None if unsaved."""
        return [c.clone() for c in self._copies] if self.saved else None

    def check(self, copies: object) -> list[torch.Tensor]:
        """``copies`` from a checkpoint, checked against this module's buffers."""
        bufs = [b for _, b in self._module.named_buffers()]
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
        named = list(self._module.named_buffers())
        self._bind(named)
        self._copies = [
            c.detach().to(device=b.device, dtype=b.dtype, copy=True)
            for c, (_, b) in zip(copies, named, strict=True)
        ]
        self.saved = True

    def forget(self) -> None:
        """The window closed: the next window saves again."""
        self.saved = False
