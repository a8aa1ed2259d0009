"""DCP's ``get_state_dict`` for one model and its optimizers, its names worked out once.

``get_state_dict`` works out every parameter's name again on each call: it walks the
model for each key of the state dict and of the optimizers' state (~1.5 ms on a
2-layer GPT with 120 tensors, more than the rest of gathering the state). Those names
depend only on the model's structure. A :class:`Gather` (one per model of a
:class:`~cudakit.checkpoint.Checkpointer`, never shared) keeps them while the
structure is the same: the state dict's keys, the parameters' names and identities,
and the parameters each optimizer steps. Then it does what ``get_state_dict`` does
with them for a model that no FSDP1 wrapper shards: the model's and each optimizer's
own ``state_dict()``, renamed.

That shortcut is used only once it has given what ``get_state_dict`` gives for that
structure (the same keys in the same order, the same tensors, equal values); a torch
whose ``get_state_dict`` does more keeps calling it, and so does an optimizer without
state (``get_state_dict`` steps it first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["Gather", "names_of"]

_STATE = "state"
_GROUPS = "param_groups"


class _Names:
    """What one structure's state dicts are renamed with."""

    def __init__(self, keys: dict[str, str], optimizers: list[list[str]]) -> None:
        self.keys = keys  # the model's state-dict key -> its name in DCP's state
        self.optimizers = optimizers  # per optimizer: parameter index -> name
        self.verified = False  # whether it gave what get_state_dict gives
        self.refused = False  # it did not: get_state_dict every time


class Gather:
    """``get_state_dict(model, optimizers)``, with the names kept while the structure is."""

    def __init__(self) -> None:
        self._structure: Any = None
        self._names: _Names | None = None
        #: How many calls took the shortcut and how many called get_state_dict (tests).
        self.short = 0
        self.full = 0

    def __call__(
        self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if not all(opt.state for opt in optimizers):
            self.full += 1  # get_state_dict steps an optimizer without state first
            return get_state_dict(model, tuple(optimizers))
        with torch.no_grad():
            model_sd = model.state_dict()
        structure = _structure(model, model_sd, optimizers)
        names = self._names if structure == self._structure else None
        if names is None:
            names = _work_out(model, optimizers, model_sd)
            self._structure, self._names = structure, names
        if names is None or names.refused:
            self.full += 1
            return get_state_dict(model, tuple(optimizers))
        try:
            short = _renamed(model_sd, optimizers, names)
        except (KeyError, IndexError, TypeError):  # state under keys it does not name
            names.refused = True
            self.full += 1
            return get_state_dict(model, tuple(optimizers))
        if not names.verified:
            self.full += 1
            expected = get_state_dict(model, tuple(optimizers))
            names.verified = _same(short, expected)
            names.refused = not names.verified
            return expected
        self.short += 1
        return short


def _structure(
    model: nn.Module, model_sd: dict[str, Any], optimizers: Sequence[torch.optim.Optimizer]
) -> tuple[Any, ...]:
    """What the names depend on: the keys, the parameters by name and identity, and the
    parameters each optimizer steps (a change in any of them works the names out again)."""
    return (
        tuple(model_sd),
        tuple((name, id(p)) for name, p in model.named_parameters()),
        tuple(tuple(id(p) for g in opt.param_groups for p in g["params"]) for opt in optimizers),
    )


def _work_out(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], model_sd: dict[str, Any]
) -> _Names | None:
    """The names ``get_state_dict`` gives, from its own helper (None: a torch without it,
    or a model an FSDP1 wrapper shards, whose state dicts it makes otherwise)."""
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - a torch that moved them
        return None
    if FullyShardedDataParallel.fsdp_modules(model):
        return None
    try:
        keys = {key: _one(_get_fqns(model, key)) for key in model_sd}
        by_param = {id(p): _one(_get_fqns(model, name)) for name, p in model.named_parameters()}
        per_opt = [
            [by_param[id(p)] for g in opt.param_groups for p in g["params"]] for opt in optimizers
        ]
    except (KeyError, ValueError, AttributeError, TypeError, RuntimeError):
        return None  # (get_state_dict raises its own error for these)
    return _Names(keys, per_opt)


def names_of(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> _Names | None:
    """The names ``get_state_dict`` gives the model's keys and each optimizer's
    parameters (None: where it makes them otherwise; see :class:`Gather`)."""
    with torch.no_grad():
        model_sd = model.state_dict()
    return _work_out(model, optimizers, model_sd)


def _one(fqns: Any) -> str:
    if len(fqns) != 1:
        raise ValueError(fqns)
    return str(next(iter(fqns)))


def _renamed(
    model_sd: dict[str, Any], optimizers: Sequence[torch.optim.Optimizer], names: _Names
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizers' state dicts under DCP's names, in its order."""
    for key in list(model_sd):
        name = names.keys[key]
        if name != key:
            model_sd[name] = model_sd.pop(key)
    if not optimizers:
        return model_sd, {}  # (get_state_dict's, for a model alone)
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for opt, params in zip(optimizers, names.optimizers, strict=True):
        osd = opt.state_dict()
        state.update((params[index], value) for index, value in osd[_STATE].items())
        for group in osd[_GROUPS]:
            group["params"] = [params[index] for index in group["params"]]
        groups.extend(osd[_GROUPS])
    return model_sd, {_STATE: state, _GROUPS: groups}


def _same(a: Any, b: Any) -> bool:
    """Whether two state dicts hold the same: keys in order, tensors over the same
    memory, equal plain values."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return _same_tensor(a, b)
    if a is b:
        return True
    try:
        equal = a == b
    except Exception:  # a value that cannot be compared: not the same
        return False
    return type(equal) is bool and equal


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    local_a, local_b = getattr(a, "_local_tensor", None), getattr(b, "_local_tensor", None)
    if local_a is not None or local_b is not None:  # a DTensor: its mesh, placements, shard
        return bool(
            local_a is not None
            and local_b is not None
            and getattr(a, "device_mesh", None) == getattr(b, "device_mesh", None)
            and getattr(a, "placements", None) == getattr(b, "placements", None)
            and a.shape == b.shape
            and _same_tensor(local_a, local_b)
        )
    return bool(
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.device == b.device
        and a.requires_grad == b.requires_grad
        and a.storage_offset() == b.storage_offset()
        and (a.is_meta or a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    )
