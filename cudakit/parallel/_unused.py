"""DDP's unused-parameter error, said with the parameters' names and the fix.

DDP reports parameters that received no gradient by index ("Parameter indices which
did not receive grad for rank 0: 2 3"), at the start of the *next* iteration, with
the gist 35 lines above and advice about ``TORCH_DISTRIBUTED_DEBUG`` at the end.
:func:`~cudakit.parallel.parallelize` remembers the DDP models it builds (weakly);
:func:`unused_parameters_hint` maps the indices back to names in them.
"""

from __future__ import annotations

import re
import weakref

from torch import nn

__all__ = ["note_unused_parameters", "remember", "unused_parameters_hint"]

_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")

#: The DDP models parallelize() built, oldest first (weakly: they go with the model).
_MODELS: list[weakref.ref[nn.Module]] = []


def remember(model: nn.Module) -> None:
    """Keep a weak reference to a DDP model ``parallelize()`` built, to name its parameters."""
    _MODELS[:] = [ref for ref in _MODELS if ref() is not None]
    _MODELS.append(weakref.ref(model))


def _reducer_names(ddp: nn.Module) -> list[str]:
    """The names of the parameters DDP's reducer indexes, in its order."""
    module = getattr(ddp, "module", ddp)
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    return [n for n, p in module.named_parameters() if p.requires_grad and n not in ignored]


def unused_parameters_hint(message: str) -> str:
    """The names and the fix for DDP's unused-parameter ``message``; ``""`` for another error.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> remember(net)
    >>> torch_says = "Parameter indices which did not receive grad for rank 0: 2 3"
    >>> print(unused_parameters_hint(torch_says))  # doctest: +ELLIPSIS
    DDP's parameters '1.weight', '1.bias' received no gradient: ...
    """
    found = _INDICES.search(message)
    if found is None:
        return ""
    indices = [int(i) for i in found.group(1).split()]
    names: list[str] = []
    for ref in reversed(_MODELS):  # the newest model that has these indices
        model = ref()
        reducer = _reducer_names(model) if model is not None else []
        if indices and max(indices) < len(reducer):
            names = [reducer[i] for i in indices]
            break
    listed = ", ".join(map(repr, names)) if names else f"with indices {found.group(1).strip()}"
    return (
        f"DDP's parameters {listed} received no gradient: the loss does not use them (a layer "
        "defined but never called, or a branch not taken). Use them in the loss, freeze them "
        "(requires_grad_(False)) before parallelize(), or pass "
        "parallelize(..., find_unused_parameters=True), which costs a walk of the autograd "
        "graph after every forward and stops DDP from overlapping some of its all-reduces "
        "with the backward."
    )


def note_unused_parameters(exc: BaseException) -> None:
    """Add :func:`unused_parameters_hint`'s names and fix to DDP's error ``exc``, once."""
    hint = unused_parameters_hint(str(exc)) if isinstance(exc, RuntimeError) else ""
    if hint and hint not in getattr(exc, "__notes__", ()):
        exc.add_note(hint)
