"""Checks of the arguments shared by ``preserve_state``, ``warmup`` and ``warmed``."""

from __future__ import annotations

import torch
from torch import nn

from .._check import check_optional, check_type

__all__ = ["check_model", "check_optimizer"]


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
