"""A recomputed block's buffers, written once per step: the forward notes which it
writes, and the recompute runs on copies of those, every buffer put back after."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["buffer_contexts"]


_MODULES: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, ...]] = weakref.WeakKeyDictionary()


def _modules(block: nn.Module) -> tuple[nn.Module, ...]:
    """The block's modules, walked once per block (a walk per step costs a few %)."""
    found = _MODULES.get(block)
    if found is None:
        found = _MODULES[block] = tuple(block.modules())
    return found


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor keeps no version: taken as written
        return None


def _stats_written_unseen(module: nn.Module) -> tuple[str, ...]:
    """Buffers the module's kernel writes without a new version: BatchNorm's running
    statistics, in training."""
    norm = nn.modules.batchnorm._NormBase
    if isinstance(module, norm) and module.training and module.track_running_stats:
        return ("running_mean", "running_var")
    return ()


class _ForwardWatch:
    """The forward's context: which buffers the block's forward writes (in place, or
    by assigning a new tensor), for the recompute to run on copies of those only.
    ``inner`` is torch's own context."""

    def __init__(self, modules: tuple[nn.Module, ...], inner: Any) -> None:
        self.modules = modules
        self.inner = inner
        self.before: list[tuple[dict[str, Any], str, torch.Tensor, int | None]] = []
        self.written: set[tuple[int, str]] = set()

    def __enter__(self) -> None:
        self.before = [
            (m._buffers, name, buf, _version(buf))
            for m in self.modules
            for name, buf in m._buffers.items()
            if buf is not None
        ]
        self.inner.__enter__()

    def __exit__(self, *exc: object) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            written = {
                (id(table), name)
                for table, name, buf, version in self.before
                if table.get(name) is not buf or version is None or _version(buf) != version
            }
            for m in self.modules:
                written.update((id(m._buffers), name) for name in _stats_written_unseen(m))
            self.written = written
            self.before = []


class _OnCopies:
    """The recompute's context: the buffers the forward wrote are copies while it runs
    again, and every buffer is put back after, so a buffer the forward writes
    (BatchNorm's running statistics, an average assigned anew) changes once per step,
    as without recompute. Entered once per recompute (again after a
    ``retain_graph=True`` backward); ``inner`` is torch's own context."""

    def __init__(self, watch: _ForwardWatch, inner: Any) -> None:
        self.watch = watch
        self.inner = inner
        self.swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []

    def __enter__(self) -> None:
        written = self.watch.written
        try:
            for module in self.watch.modules:  # before torch's context: not the block's ops
                table = module._buffers
                for name, buf in table.items():
                    if buf is not None:
                        self.swapped.append((table, name, buf))
                        if (id(table), name) in written:
                            table[name] = buf.clone()
            self.inner.__enter__()
        except BaseException:  # an out-of-memory copy: `with` calls no __exit__
            self._restore()
            raise

    def __exit__(self, *exc: object) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            self._restore()

    def _restore(self) -> None:
        # Every buffer back, also one the forward assigned anew (``self.mean = ...``):
        # the recompute's assignment would count the batch a second time.
        for table, name, buf in self.swapped:
            table[name] = buf
        self.swapped = []


def buffer_contexts(block: nn.Module, forward: Any, again: Any) -> tuple[Any, Any]:
    """checkpoint's two contexts around torch's own (``forward``, ``again``): the
    forward's noting what it writes, the recompute's on copies of those."""
    watch = _ForwardWatch(_modules(block), forward)
    return watch, _OnCopies(watch, again)
