"""What an initialisation wrote: one module at a time, seeded from its name.

:func:`~cudakit.parallel.materialize` runs a model's init one submodule at a time,
each under its own seed (:func:`module_seed`, from ``init_seed`` and the module's
name), on tensors it hands the module for the call. :class:`Watch` records which of
those tensors the init wrote: an in-place op (its version counter moves), an
assignment (the module holds another tensor afterwards), or a write through
``.data`` or ``nn.init``'s meta shortcut (``trunc_normal_`` returns at once on the
meta device after reading ``is_meta``), seen by a ``TorchFunctionMode``.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["InitFn", "Watch", "call_init", "module_seed", "seeded", "whole_model_init"]

#: ``init(module)`` or ``init(module, name)``: writes the module's own tensors.
InitFn = Callable[..., Any]

# The properties whose read stands for a write: `.data` (`w.data.normal_()` writes
# through a tensor with its own version counter) and `is_meta` (nn.init's shortcut).
_WRITE_PROPERTIES = (torch.Tensor.data, torch.Tensor.is_meta)


def module_seed(init_seed: int, name: str) -> int:
    """The seed of the module called ``name``: the same on every rank, at any world size.

    >>> module_seed(0, "layers.0.attn") == module_seed(0, "layers.0.attn")
    True
    >>> module_seed(0, "layers.0.attn") != module_seed(1, "layers.0.attn")
    True
    """
    digest = hashlib.sha256(f"{init_seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The CPU's generator and ``device``'s seeded with ``seed``; both put back after."""
    devices: list[int] = []
    if device.type != "cpu" and device.type != "meta":
        module = torch.get_device_module(device.type)
        index = device.index if device.index is not None else module.current_device()
        devices = [index]
    kind = device.type if devices else "cuda"
    with torch.random.fork_rng(devices=devices, device_type=kind):
        torch.default_generator.manual_seed(seed)  # the CPU only: no lazy CUDA seeding
        if devices:
            with torch.get_device_module(device.type).device(devices[0]):
                torch.get_device_module(device.type).manual_seed(seed)
        yield


class Watch(TorchFunctionMode):
    """Records the tensors (by id) whose ``.data`` or ``is_meta`` an init read."""

    def __init__(self, watched: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.watched = watched
        #: ids of watched tensors written through ``.data`` or ``nn.init``'s shortcut.
        self.written: set[int] = set()

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        owner = getattr(func, "__self__", None)
        if any(owner is p for p in _WRITE_PROPERTIES) and args and id(args[0]) in self.watched:
            self.written.add(id(args[0]))
        out = kwargs.get("out") if kwargs else None
        if isinstance(out, torch.Tensor) and id(out) in self.watched:
            self.written.add(id(out))
        return func(*args, **(kwargs or {}))


def _takes_name(init: InitFn) -> bool:
    """Whether ``init`` takes two positional arguments: ``init(module, name)``."""
    try:
        params = list(inspect.signature(init).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in kinds for p in params) >= 2


def whole_model_init(init: object) -> bool:
    """Whether ``init`` is a module's method that takes no module: every argument
    optional (torchtitan's ``model.init_weights(buffer_device=None)``, a
    ``model.reset_parameters``). It initialises its own module, the whole model,
    not the one module it would be handed."""
    if not isinstance(getattr(init, "__self__", None), nn.Module):
        return False
    try:
        params = list(inspect.signature(cast(Any, init)).parameters.values())
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return False
    return all(p.default is not inspect.Parameter.empty for p in params if p.kind in kinds)


def call_init(init: InitFn | None) -> Callable[[nn.Module, str], None]:
    """How to initialise one module: ``init(module[, name])``, or its ``reset_parameters()``."""
    if init is None:

        def own(module: nn.Module, name: str) -> None:
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()

        return own
    if _takes_name(init):
        return lambda module, name: init(module, name)
    return lambda module, name: init(module)
