"""The tensor operations of a step that need care: clearing gradients cheaply, an
optimizer step that skips on the device, and the region ``compile=`` compiles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["check_and_clip", "step_on_device", "zero_grad"]

_OPTIMIZER_ZERO_GRAD = torch.optim.Optimizer.zero_grad
# True while a torch profiler records (then zero_grad keeps its record_function scope).
_profiler_enabled: Callable[[], bool] = getattr(torch.autograd, "_profiler_enabled", lambda: True)


def zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``, minus its per-call overhead where that is safe.

    For an optimizer that keeps torch's own ``zero_grad`` (not overridden by its class or
    on the instance), and while no profiler records, this is the same loop torch runs
    (every ``.grad`` set to None) without the dynamo-disable wrapper and
    ``record_function`` scope around it. Otherwise the call.
    """
    if (
        getattr(optimizer.zero_grad, "__func__", None) is not _OPTIMIZER_ZERO_GRAD
        or _profiler_enabled()
    ):
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad = None


def step_on_device(opt: torch.optim.Optimizer, verdict: torch.Tensor) -> None:
    """``opt.step()`` with ``found_inf``: the optimizer skips on the device if it is set."""
    holder: Any = opt
    holder.grad_scale = None
    holder.found_inf = verdict.reshape(())  # 0-dim, like the step counts it is subtracted from
    try:
        opt.step()
    finally:
        del holder.grad_scale
        del holder.found_inf


def check_and_clip(
    checks: list[torch.Tensor],
    flag: torch.Tensor,
    one: torch.Tensor,
    params: list[torch.Tensor] | None,
    max_norm: float | None,
) -> torch.Tensor | None:
    """The guard's fused inf/NaN check, then clipping: the region ``compile=`` compiles."""
    torch._amp_foreach_non_finite_check_and_unscale_(checks, flag, one)
    if params is None or max_norm is None:
        return None
    return torch.nn.utils.clip_grad_norm_(params, max_norm)
