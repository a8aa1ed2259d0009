"""What an initialisation wrote: one module at a time, seeded from its name.

:func:`~cudakit.parallel.materialize` runs a model's init one submodule at a time,
each under its own seed (:func:`module_seed`, from ``init_seed`` and the module's
name), on tensors it hands the module for the call. :class:`Watch` records which of
those tensors the init wrote: an in-place op (its version counter moves), an
assignment (the module holds another tensor afterwards), or a write through
``.data`` or ``nn.init``'s meta shortcut (``trunc_normal_`` returns at once on the
meta device after reading ``is_meta``), seen by a ``TorchFunctionMode``.

The mode also records which tensors were written whole: an op that writes every
element it is given (``normal_``, ``uniform_``, ``zero_``, ``fill_``, ``copy_``, an
``nn.init`` function, ``out=``) called on the tensor itself or on a contiguous view
of all of its bytes (``.data``, ``view(-1)``), and holding the same memory, seen the
same way, at the end (``set_`` or ``.data =`` after the write takes it back). On the
meta device,
``nn.init``'s shortcut counts as a whole write too: on a real device those
functions write every element. Anything else (a slice, ``fill_diagonal_``, an
item, ``mul_``) writes a part, as far as the mode can tell.
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

# In-place methods that write every element of the tensor they are called on (kept by
# id, as the functions below: a function need not be hashable).
_WHOLE_METHODS = frozenset(
    id(getattr(torch.Tensor, name))
    for name in (
        "normal_",
        "uniform_",
        "zero_",
        "fill_",
        "copy_",
        "bernoulli_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
        "random_",
    )
)
# nn.init's functions: each writes every element of the tensor it gets (those that
# dispatch to a mode themselves are seen as one call, the ops inside them are not).
_WHOLE_INITS = frozenset(
    id(getattr(nn.init, name))
    for name in (
        "uniform_",
        "normal_",
        "trunc_normal_",
        "constant_",
        "ones_",
        "zeros_",
        "eye_",
        "dirac_",
        "xavier_uniform_",
        "xavier_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "orthogonal_",
        "sparse_",
    )
)


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


def _storage(tensor: torch.Tensor) -> Any:
    """The storage ``tensor`` views (None for one without a plain storage)."""
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _storage_key(tensor: torch.Tensor) -> int | None:
    """Which storage ``tensor`` views: the same number for every view of it."""
    storage = _storage(tensor)
    return None if storage is None else int(storage._cdata)


def _same_bytes(view: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``view``, on ``tensor``'s storage, covers exactly its bytes."""
    return bool(
        view.is_contiguous()
        and tensor.is_contiguous()
        and view.nbytes == tensor.nbytes
        and view.storage_offset() * view.element_size()
        == tensor.storage_offset() * tensor.element_size()
    )


class Watch(TorchFunctionMode):
    """Records the tensors (by id) an init wrote through ``.data``, ``is_meta`` or
    ``out=``, and those it wrote whole."""

    def __init__(self, watched: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.watched = watched
        #: ids of watched tensors written through ``.data`` or ``nn.init``'s shortcut.
        self.written: set[int] = set()
        #: ids of watched tensors every element of which an op wrote.
        self.whole: set[int] = set()
        self._by_storage: dict[int, list[int]] = {}
        self._layout: dict[int, tuple[Any, ...]] = {}
        for key, t in watched.items():
            storage = _storage(t)  # held: no other storage takes its address meanwhile
            if storage is not None:
                self._by_storage.setdefault(int(storage._cdata), []).append(key)
            self._layout[key] = (storage, _storage_key(t), t.storage_offset(), t.stride())

    def whole_at_end(self) -> set[int]:
        """The watched tensors written whole that still hold that memory, seen the same
        way (``set_`` or ``.data =`` after the write gives a tensor other memory)."""
        return {
            key
            for key in self.whole
            if self._layout[key][1:]
            == (
                _storage_key(self.watched[key]),
                self.watched[key].storage_offset(),
                self.watched[key].stride(),
            )
        }

    def _covered(self, target: object) -> list[int]:
        """The watched tensors every element of which ``target`` is."""
        if not isinstance(target, torch.Tensor):
            return []
        if id(target) in self.watched:
            return [id(target)]
        storage = _storage_key(target)
        keys = self._by_storage.get(storage, []) if storage is not None else []
        return [k for k in keys if _same_bytes(target, self.watched[k])]

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else kwargs.get("tensor")
        owner = getattr(func, "__self__", None)
        if any(owner is p for p in _WRITE_PROPERTIES) and id(first) in self.watched:
            self.written.add(id(first))
            if owner is torch.Tensor.is_meta and self.watched[id(first)].device.type == "meta":
                self.whole.add(id(first))  # nn.init's shortcut: whole on a device
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor) and id(out) in self.watched:
            self.written.add(id(out))
        result = func(*args, **kwargs)
        if id(func) in _WHOLE_METHODS or id(func) in _WHOLE_INITS:
            self.whole.update(self._covered(first))
        self.whole.update(self._covered(out))
        return result


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
