"""Undoing parallelize(): the user's own module back, and state dicts with bare keys.

:func:`unwrap` peels DataParallel, DDP and ``torch.compile`` wrappers;
:func:`state_dict` and :func:`load_state_dict` save and load with bare keys (FSDP2:
full state dicts, gathered on rank 0), and a load that does not fit leaves the
model as it was.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from .._check import check_bool, check_type

__all__ = ["LoadResult", "is_fsdp2", "load_state_dict", "state_dict", "unwrap"]


def _compiled_type() -> type[nn.Module] | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # pragma: no cover - torch without dynamo
        return None
    return cast(type[nn.Module], OptimizedModule)


def _check_module(func: str, model: object) -> None:
    check_type(
        func,
        "model",
        model,
        nn.Module,
        expected="an nn.Module",
        fix="Pass the model (the object parallelize() or torch.compile() returned).",
    )


def unwrap(model: nn.Module) -> nn.Module:
    """Return the user's own module from inside DataParallel, DDP and ``torch.compile`` wrappers.

    >>> import torch, cudakit.parallel as cp
    >>> net = torch.nn.Linear(2, 2)
    >>> cp.unwrap(torch.nn.DataParallel(net)) is net
    True

    Nested wrappers (``torch.compile(DDP(model))``, ``DDP(torch.compile(model))``)
    are peeled all the way. FSDP2 (``fully_shard``) changes the module in place and
    has no wrapper, so the module is returned as it is.

    Args:
        model: any ``nn.Module``.

    Returns:
        The innermost module.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    .. versionadded:: 0.1
    """
    _check_module("unwrap", model)
    compiled = _compiled_type()
    wrappers: tuple[type[nn.Module], ...] = (
        nn.DataParallel,
        nn.parallel.DistributedDataParallel,
    )
    for _ in range(64):  # wrappers nest a few levels at most; never loop forever
        if isinstance(model, wrappers):
            model = cast(nn.Module, model.module)
        elif compiled is not None and isinstance(model, compiled):
            model = cast(nn.Module, model._orig_mod)
        else:
            break
    return model


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` was sharded with FSDP2 (``fully_shard``)."""
    # A model can only be sharded once torch.distributed.fsdp was imported, so never pay
    # for that import (over a second) just to answer no.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module_type = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    return module_type is not None and isinstance(model, module_type)


def state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's state dict with bare keys: no ``module.`` or ``_orig_mod.`` prefix.

    >>> import torch, cudakit.parallel as cp
    >>> wrapped = torch.nn.DataParallel(torch.nn.Linear(2, 2))
    >>> list(cp.state_dict(wrapped))
    ['weight', 'bias']

    Loads into the bare model, the wrapped one, or a ``torch.compile``-d one with
    :func:`load_state_dict`. For an FSDP2 model this is a collective (every rank
    must call it): rank 0 receives the full, unsharded state dict on the CPU, the
    other ranks an empty dict.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    .. versionadded:: 0.1
    """
    _check_module("state_dict", model)
    inner = unwrap(model)
    if is_fsdp2(inner):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return inner.state_dict()


_PREFIXES = ("module.", "_orig_mod.")


def _strip(sd: Mapping[str, Any], own_keys: set[str]) -> Mapping[str, Any]:
    """Drop leading wrapper prefixes until the keys match the model's own (or none is left)."""
    keys = list(sd)
    prefix = ""
    while keys:
        if own_keys and {k[len(prefix) :] for k in keys} & own_keys:
            break  # already matches: a submodule really called `module` keeps its name
        step = next((p for p in _PREFIXES if all(k.startswith(prefix + p) for k in keys)), None)
        if step is None:
            break
        prefix += step
    if not prefix:
        return sd
    out: OrderedDict[str, Any] = OrderedDict((k[len(prefix) :], v) for k, v in sd.items())
    meta = getattr(sd, "_metadata", None)
    if isinstance(meta, Mapping):
        bare = prefix[:-1]
        new_meta: OrderedDict[str, Any] = OrderedDict()
        for k, v in meta.items():
            if k == bare:
                new_meta[""] = v
            elif k.startswith(prefix):
                new_meta[k[len(prefix) :]] = v
            elif k == "" or prefix.startswith(k + "."):
                continue  # the wrappers' own entries
            else:
                new_meta[k] = v
        out._metadata = new_meta  # type: ignore[attr-defined]
    return out


class LoadResult(NamedTuple):
    """What :func:`load_state_dict` returns: the keys that did not match.

    Like the result of ``nn.Module.load_state_dict``, after ``module.`` and
    ``_orig_mod.`` prefixes are taken off; both lists are empty when every key matched.

    >>> import torch, cudakit.parallel as cp
    >>> missing, unexpected = cp.load_state_dict(
    ...     torch.nn.Linear(2, 2), {}, strict=False
    ... )
    >>> missing, unexpected
    (['weight', 'bias'], [])

    .. versionadded:: 0.1
    """

    #: The model's keys that the state dict did not have.
    missing_keys: list[str]
    #: The state dict's keys that the model does not have.
    unexpected_keys: list[str]


class _StateMismatchError(ValueError, RuntimeError):
    """A state dict that does not fit the model: a wrong value (``ValueError``), and the
    ``RuntimeError`` ``nn.Module.load_state_dict`` raises for it."""


def _may_not_fit(own: Mapping[str, Any], given: Mapping[str, Any], strict: bool) -> bool:
    """Whether torch's load may refuse ``given`` (a key set that differs under
    ``strict``, a value that is not a tensor, a tensor of another shape, or a complex one
    into a real tensor), after copying what did fit."""
    if strict and own.keys() != given.keys():
        return True
    for key, value in given.items():
        mine = own.get(key)
        if not isinstance(mine, torch.Tensor) or nn.parameter.is_lazy(mine):
            continue
        if not isinstance(value, torch.Tensor) or mine.shape != value.shape:
            return True
        if value.is_complex() and not mine.is_complex():
            return True
    return False


def _load_or_restore(inner: nn.Module, state: Mapping[str, Any], strict: bool) -> Any:
    """``inner.load_state_dict(state)``, the model put back as it was if torch refuses.

    Torch copies every tensor that fits before it raises for those that do not; a copy of
    the model's tensors is taken only when the state may not fit, so a load that fits
    costs nothing more.
    """
    own = inner.state_dict()
    if not _may_not_fit(own, state, strict):
        return inner.load_state_dict(state, strict=strict)
    saved = {k: v.detach().clone() for k, v in own.items() if isinstance(v, torch.Tensor)}
    try:
        return inner.load_state_dict(state, strict=strict)
    except RuntimeError as exc:
        reason = str(exc).strip().rstrip(".")
        with torch.no_grad():
            for key, value in inner.state_dict().items():
                if key in saved and isinstance(value, torch.Tensor):
                    value.copy_(saved[key])
        raise _StateMismatchError(
            f"load_state_dict(state=...) got a state dict that does not fit the "
            f"{type(inner).__name__}, so nothing was loaded: {reason}. Pass the state dict "
            "of this model, or strict=False to load the keys that match and get the others "
            "back in the result."
        ) from None


def load_state_dict(
    model: nn.Module, state: Mapping[str, Any], *, strict: bool = True
) -> LoadResult:
    """Load a state dict saved with or without ``module.`` / ``_orig_mod.`` prefixes.

    >>> import torch, cudakit.parallel as cp
    >>> wrapped = torch.nn.DataParallel(torch.nn.Linear(2, 2))
    >>> bare = torch.nn.Linear(2, 2)
    >>> cp.load_state_dict(bare, wrapped.state_dict())  # keys 'module.weight', ...
    LoadResult(missing_keys=[], unexpected_keys=[])
    >>> torch.equal(bare.weight, wrapped.module.weight)
    True

    The state dict is not modified. For an FSDP2 model this is a collective: pass
    the full state dict on rank 0 (as :func:`state_dict` returns it) and anything
    (e.g. ``{}``) on the other ranks; rank 0 broadcasts it.

    Args:
        model: the target, bare or wrapped.
        state: a state dict from :func:`state_dict`, ``model.state_dict()`` or a checkpoint.
        strict: as in ``nn.Module.load_state_dict``.

    Returns:
        The missing and unexpected keys, as ``nn.Module.load_state_dict`` reports them.

    Raises:
        TypeError: ``state`` is not a mapping, ``model`` is not an ``nn.Module``, or
            ``strict`` is not a bool.
        ValueError: with ``strict=True``, keys that do not match, or (with any
            ``strict``) a tensor of another shape: torch's message, after the model was
            put back as it was. The exception is a ``RuntimeError`` too, as torch's is.

    .. versionadded:: 0.1
    """
    _check_module("load_state_dict", model)
    check_type(
        "load_state_dict",
        "state",
        state,
        Mapping,
        expected="a mapping of parameter names to tensors",
        fix="If you saved a whole checkpoint, pass checkpoint['model'] (or whichever key holds "
        "the model's state).",
    )
    check_bool("load_state_dict", "strict", strict)
    inner = unwrap(model)
    if is_fsdp2(inner):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
        # The model's own names (no collective): a submodule really called `module` keeps it.
        own = set(inner.state_dict().keys())
        bare = dict(_strip(state, own)) if state else {}
        res = set_model_state_dict(inner, bare, options=opts)
        return LoadResult(list(res.missing_keys), list(res.unexpected_keys))
    own = set(inner.state_dict().keys())
    res = _load_or_restore(inner, _strip(state, own), strict)
    return LoadResult(list(res.missing_keys), list(res.unexpected_keys))
