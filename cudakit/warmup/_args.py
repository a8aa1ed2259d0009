"""Checks of the arguments shared by ``preserve_state``, ``warmup`` and ``warmed``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .._check import check_optional, check_type

__all__ = ["check_extra", "check_model", "check_optimizer"]


def check_model(model: object, func: str) -> nn.Module | None:
    """``model`` if it is ``None`` or a module whose parameters all exist."""
    if model is None:
        return None
    module = check_type(
        func,
        "model",
        model,
        nn.Module,
        expected="a torch.nn.Module",
        fix="Pass the module itself (not its state_dict or parameters()).",
    )
    where = f"{func}()"
    lazy = [n for n, p in module.named_parameters() if nn.parameter.is_lazy(p)]
    if lazy:
        raise ValueError(
            f"{where} got a model with uninitialized lazy parameters ({', '.join(lazy[:3])}); "
            "a warm-up pass would materialize them and that cannot be undone. Run one "
            "forward pass first, e.g. `model(example_input)`, then call it again."
        )
    return module


def check_optimizer(optimizer: object, func: str) -> torch.optim.Optimizer | None:
    """``optimizer`` if it is ``None`` or an optimizer."""
    return check_optional(
        check_type,
        func,
        "optimizer",
        optimizer,
        types=torch.optim.Optimizer,
        expected="a torch.optim.Optimizer or None",
        fix="Pass the optimizer object; put schedulers and GradScalers in extra=(...).",
    )


def check_extra(extra: object, func: str) -> tuple[Any, ...]:
    """``extra`` as a tuple of objects with ``state_dict()`` and ``load_state_dict()``,
    tensors (values, ``requires_grad`` and ``.grad``) and ``torch.Generator`` objects."""
    where = f"{func}()"
    if not isinstance(extra, Iterable) or isinstance(extra, (str, bytes)):
        raise TypeError(
            f"{where} expects extra to be a tuple of objects with state_dict() and "
            f"load_state_dict(), got {type(extra).__name__}. For one object write extra=(obj,)."
        )
    items = tuple(extra)
    for obj in items:
        if isinstance(obj, type):
            name = obj.__name__
            raise TypeError(
                f"{where} got the class {name} in extra, not an object made from it: pass the "
                f"{name} you train with, e.g. extra=(obj,) where obj = {name}(...)."
            )
        if isinstance(obj, (torch.Tensor, torch.Generator)):
            continue
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"{where} can only preserve extra objects that have state_dict() and "
                f"load_state_dict(), tensors and torch.Generator objects; "
                f"{type(obj).__name__} is none of these. Preserve it yourself or leave it out."
            )
    return items
