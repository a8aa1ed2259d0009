"""The tensor operations of a step that need care: clearing gradients and stepping the
optimizer cheaply, an optimizer step that skips on the device, and the region
``compile=`` compiles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.optim.optimizer as _optimizer_module
from torch.amp.grad_scaler import OptState as _OptState

__all__ = [
    "check_and_clip",
    "check_clip_and_judge",
    "optimizer_step",
    "scaler_step",
    "step_on_device",
    "zero_grad",
]

_OPTIMIZER_ZERO_GRAD = torch.optim.Optimizer.zero_grad
# True while a torch profiler records (then zero_grad keeps its record_function scope).
_profiler_enabled: Callable[[], bool] = getattr(torch.autograd, "_profiler_enabled", lambda: True)
# torch wraps every optimizer class's step() once in this wrapper (record_function
# scope, hooks); its code object tells that wrapper from anything else.
_profile_hook_step: Any = getattr(torch.optim.Optimizer, "profile_hook_step", None)
_HOOKED_STEP_CODE = (
    _profile_hook_step(lambda *a, **k: None).__code__ if _profile_hook_step is not None else None
)
# torch's global step hooks (dicts, empty unless registered); None on a torch without them.
_GLOBAL_PRE_HOOKS: Any = getattr(_optimizer_module, "_global_optimizer_pre_hooks", None)
_GLOBAL_POST_HOOKS: Any = getattr(_optimizer_module, "_global_optimizer_post_hooks", None)
#: Whether this torch has the wrapper and the hooks :func:`optimizer_step` knows.
_CAN_UNWRAP = None not in (_HOOKED_STEP_CODE, _GLOBAL_PRE_HOOKS, _GLOBAL_POST_HOOKS)


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


def optimizer_step(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer.step()``, minus torch's per-call profiler scope where that is safe.

    torch wraps each optimizer class's ``step`` in a ``record_function`` scope that is
    entered on every call, profiler or not; on a small model it costs more than the
    non-finite guard. Where the call would reach that wrapper directly (``step`` not
    replaced on the instance, or replaced only by an LR scheduler's step tracking), no
    step hook is registered, no profiler records and dynamo is not tracing, this runs
    what the wrapper runs inside its scope: the class's step (the subclass's own, if it
    overrides it) and ``_optimizer_step_code()``, then any post-hook the step itself
    registered, and marks the optimizer stepped for its LR scheduler. Otherwise the call.

    An observer that records ``record_function`` scopes without the profiler being on
    (an ``ExecutionTraceObserver`` started on its own) cannot be detected and misses
    this scope; run it through ``torch.profiler.profile(execution_trace_observer=...)``.
    """
    inner = _unwrapped_step(optimizer)
    if inner is None:
        return optimizer.step()
    if "step" in optimizer.__dict__:
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what the scheduler's wrapper sets
    out = inner(optimizer)
    optimizer._optimizer_step_code()
    # torch's wrapper looks the post-hooks up after the step: run any the step added.
    post = optimizer._optimizer_step_post_hooks
    if post or _GLOBAL_POST_HOOKS:
        for hook in (*post.values(), *_GLOBAL_POST_HOOKS.values()):
            hook(optimizer, (optimizer,), {})
    return out


def _unwrapped_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any] | None:
    """The function torch's step wrapper would call, or None where the call must be made."""
    if not _CAN_UNWRAP or torch.compiler.is_compiling():
        return None  # another torch, or dynamo tracing the call as written
    cls_step = getattr(type(optimizer), "step", None)
    if getattr(cls_step, "__code__", None) is not _HOOKED_STEP_CODE:
        return None  # not torch's wrapper: an optimizer of another kind
    patched = optimizer.__dict__.get("step")
    if patched is not None and not (
        getattr(patched, "_wrapped_by_lr_sched", False)
        and getattr(patched, "__wrapped__", None) is cls_step
    ):
        return None  # replaced on the instance by something other than an LR scheduler
    if (
        _GLOBAL_PRE_HOOKS
        or _GLOBAL_POST_HOOKS
        or getattr(optimizer, "_optimizer_step_pre_hooks", True)
        or getattr(optimizer, "_optimizer_step_post_hooks", True)
        or _profiler_enabled()
    ):
        return None  # hooks to run, or a profiler that wants the scope
    inner = getattr(cls_step, "__wrapped__", None)
    return cast(Callable[..., Any], inner) if callable(inner) else None


# GradScaler and its deprecated per-device aliases, which keep its step().
_PLAIN_SCALERS: tuple[type, ...] = tuple(
    cls
    for cls in (
        torch.amp.GradScaler,
        getattr(getattr(torch.cuda, "amp", None), "GradScaler", None),
        getattr(getattr(torch.cpu, "amp", None), "GradScaler", None),
    )
    if isinstance(cls, type)
)


def scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> Any:
    """``scaler.step(optimizer)`` for a step the guard has already found clean.

    After ``unscale_`` (the scaler's flags hold the verdict cudakit read: zero here),
    torch's ``GradScaler.step`` of an optimizer that cannot skip on the device reads the
    flags again (one more host read per optimizer) and calls ``optimizer.step()``. For a
    plain ``GradScaler`` and such an optimizer, this makes the step through
    :func:`optimizer_step` and marks the optimizer stepped, as ``GradScaler.step``
    does. Otherwise (a scaler subclass, a fused optimizer, a state it did not unscale)
    the call.
    """
    states: Any = getattr(scaler, "_per_optimizer_states", None)
    state = states.get(id(optimizer)) if isinstance(states, dict) else None
    if (
        type(scaler) not in _PLAIN_SCALERS
        or state is None
        or state.get("stage") is not _OptState.UNSCALED
        or not state.get("found_inf_per_device")
        or getattr(optimizer, "_step_supports_amp_scaling", False)
    ):
        return scaler.step(optimizer)
    out = optimizer_step(optimizer)
    state["stage"] = _OptState.STEPPED
    return out


def step_on_device(opt: torch.optim.Optimizer, verdict: torch.Tensor) -> None:
    """``opt.step()`` with ``found_inf``: the optimizer skips on the device if it is set."""
    holder: Any = opt
    holder.grad_scale = None
    holder.found_inf = verdict.reshape(())  # 0-dim, like the step counts it is subtracted from
    try:
        optimizer_step(opt)
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


def check_clip_and_judge(
    checks: list[torch.Tensor],
    flag: torch.Tensor,
    one: torch.Tensor,
    params: list[torch.Tensor],
    max_norm: float,
    loss: torch.Tensor | None,
    watch_norm: bool,
    levels: tuple[float, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`check_and_clip`, then the spike test: the region ``compile=`` compiles when
    a spike rule watches the window (one process, no scaler).

    The statistics are the window's ``loss`` (float32) and/or the clipping norm
    (``watch_norm``), in the rule's order; ``levels`` are their thresholds. Returns the
    clipping norm, the skip flag (1 for a non-finite window or a spike, else 0) and
    the tensor to post: the non-finite flag, then the statistics. Compiled, the test
    joins the kernels of the check and the clipping: no launch of its own.
    """
    norm = cast(torch.Tensor, check_and_clip(checks, flag, one, params, max_norm))
    values = []
    if loss is not None:
        values.append(loss.float().reshape(1))
    if watch_norm:
        values.append(norm.float().reshape(1))
    skip = flag
    for value, level in zip(values, levels, strict=True):
        skip = torch.where(value > level, one, skip)
    return norm, skip, torch.cat([flag, *values])
