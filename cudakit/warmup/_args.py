"""Checks of the arguments shared by ``preserve_state``, ``warmup`` and ``warmed``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["check_extra", "check_model", "check_optimizer"]


def check_model(model: object, where: str) -> nn.Module | None:
    if model is None:
        return None
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{where} expects model to be a torch.nn.Module, got {type(model).__name__}. "
            "Pass the module itself (not its state_dict or parameters())."
        )
    lazy = [n for n, p in model.named_parameters() if nn.parameter.is_lazy(p)]
    if lazy:
        raise ValueError(
            f"{where} got a model with uninitialized lazy parameters ({', '.join(lazy[:3])}); "
            "a warm-up pass would materialize them and that cannot be undone. Run one "
            "forward pass first, e.g. `model(example_input)`, then call it again."
        )
    return model


def check_optimizer(optimizer: object, where: str) -> torch.optim.Optimizer | None:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise TypeError(
        f"{where} expects optimizer to be a torch.optim.Optimizer or None, got "
        f"{type(optimizer).__name__}. Pass the optimizer object; put schedulers and "
        "GradScalers in extra=(...)."
    )


def check_extra(extra: object, where: str) -> tuple[Any, ...]:
    if not isinstance(extra, Iterable) or isinstance(extra, (str, bytes)):
        raise TypeError(
            f"{where} expects extra to be a tuple of objects with state_dict() and "
            f"load_state_dict(), got {type(extra).__name__}. For one object write extra=(obj,)."
        )
    items = tuple(extra)
    for obj in items:
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"{where} can only preserve extra objects that have state_dict() and "
                f"load_state_dict(); {type(obj).__name__} has not. Preserve it yourself or "
                "leave it out."
            )
    return items
