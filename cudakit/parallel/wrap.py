"""Wrapping: :func:`parallelize` carries out the plan (:mod:`.unwrapped` undoes it).

:func:`parallelize` checks its arguments, gathers the facts once
(:func:`~cudakit.parallel.strategy.gather_facts`), lets the pure
:func:`~cudakit.parallel.strategy.choose_plan` decide, then acts: creates the
group if the plan says so, moves the model, wraps it and logs the decision once.
"""

from __future__ import annotations

import datetime
import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn

from .._accel import current_cuda_index
from .._blocks import repeated_blocks
from .._check import fail_type
from .._dist import group_rank, group_world_size
from ..device import DeviceLike
from ._args import WRAPPER_NAMES, check_option_names, fully_shard
from ._unused import remember
from .group import (
    ProcessGroupInfo,
    check_timeout,
    ensure_group,
    teardown_owned_group,
)
from .meta import MetaBuild, check_init, plan_build
from .ranks import is_main_process
from .recompute import Recompute, apply_recompute, as_recompute, plan_recompute
from .strategy import (
    ParallelFacts,
    ParallelPlan,
    check_backend,
    check_strategy,
    choose_plan_for,
    gather_facts,
)
from .unwrapped import is_fsdp2, unwrap

__all__ = ["parallelize"]

logger = logging.getLogger("cudakit")


def _check_plan(model: nn.Module, plan: ParallelPlan, build: MetaBuild | None) -> None:
    """Everything that can refuse the plan for this model, before anything happens."""
    # The options' names and values were checked by the plan (choose_plan_for).
    if build is not None and plan.strategy == "dp":
        raise ValueError(
            f"parallelize() got a {type(model).__name__} built on the meta device, and "
            "DataParallel copies the whole model from its first GPU at every step. Launch "
            "with `torchrun --nproc-per-node N script.py` (DDP, or strategy='fsdp' to "
            "shard it), or allocate it first: cudakit.parallel.materialize(model, 'cuda:0')."
        )
    if plan.strategy == "ddp" and plan.device.type == "meta":
        raise ValueError(
            "parallelize(device='meta') with DDP: DistributedDataParallel broadcasts the "
            "weights from rank 0, and meta tensors hold no data. Pass the training device "
            "(or None); to build a large model without memory use strategy='fsdp' on the "
            "meta device, then model.to_empty(...) and initialise it."
        )
    if plan.strategy == "ddp" and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "parallelize() with DDP needs a model with trainable parameters, but "
            f"{type(model).__name__} has none requiring grad. Unfreeze some, or use "
            "strategy='none' for inference."
        )


def _wrapped_kind(model: nn.Module) -> str | None:
    """``"ddp"``, ``"dp"`` or ``"fsdp"`` for a model parallelize() would return as it is."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "ddp"
    if isinstance(model, nn.DataParallel):
        return "dp"
    return "fsdp" if is_fsdp2(model) else None


def _check_wrapped(model: nn.Module, kind: str, request: str, options: Mapping[str, Any]) -> None:
    """An already wrapped model: its options are still checked, another wrapper refused."""
    if request in WRAPPER_NAMES and request != kind:
        raise ValueError(
            f"parallelize(strategy={request!r}): the model is already wrapped in "
            f"{type(model).__name__}; wrapping it in {WRAPPER_NAMES[request]} too would nest "
            "two wrappers. Pass the bare model (cudakit.parallel.unwrap(model)), or "
            "strategy='auto' to keep the wrapper it has."
        )
    if request == "auto":  # the options are DDP's, as for a bare model under "auto"
        check_option_names("parallelize", "ddp", options, auto=True)
    else:
        check_option_names("parallelize", kind, options)


def _sharded(module: nn.Module) -> bool:
    """Whether fully_shard() has touched ``module`` (it records one before checking)."""
    if is_fsdp2(module):
        return True
    try:
        from torch.distributed._composable_state import _get_module_state
    except ImportError:  # pragma: no cover - a torch without the composable registry
        return False
    return _get_module_state(module) is not None


def _undo_move(model: nn.Module, was_on: set[torch.device], dev: torch.device) -> str:
    """Move a model the wrapper refused back where it was; say what could be undone."""
    if any(_sharded(m) for m in model.modules()):
        return "Some of its blocks were already sharded: build the model again."
    if len(was_on) > 1:
        return f"Its tensors were on several devices; they are now all on {dev}."
    if was_on and dev not in was_on:
        try:
            model.to(next(iter(was_on)))
        except Exception as err:  # e.g. nothing to copy back from the meta device
            return f"Moving it back to {next(iter(was_on))} failed too ({err!r})."
    return "The model is as it was."


def _devices_of(model: nn.Module) -> set[torch.device]:
    """The devices the model's parameters and buffers are on."""
    return {t.device for t in itertools.chain(model.parameters(), model.buffers())}


def _refused(exc: Exception, kind: str, undone: str) -> Exception:
    """The wrapper's own TypeError/ValueError, its text naming parallelize() and the wrapper."""
    if type(exc) not in (TypeError, ValueError):
        return exc
    return type(exc)(
        f"parallelize(): {WRAPPER_NAMES[kind]} refused the model or the options passed "
        f"through parallelize(**ddp_kwargs): {exc} {undone}"
    )


def _self_contained(model: nn.Module) -> Callable[[nn.Module], bool]:
    """Whether a block shares no parameter and no submodule with a module outside it.

    FSDP2 shards a shared tensor once, in one unit: a block tied to another (weights
    shared across layers, one module in two blocks) stays in the root's unit.
    """
    parents: dict[int, set[int]] = {}
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for child in module.children():
            parents.setdefault(id(child), set()).add(id(module))
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), set()).add(id(module))

    def alone(block: nn.Module) -> bool:
        inside = {id(m) for m in block.modules()}
        return all(
            parents.get(id(m), set()) <= inside for m in block.modules() if m is not block
        ) and all(holders[id(p)] <= inside for p in block.parameters())

    return alone


def _shard(model: nn.Module, kwargs: Mapping[str, Any]) -> nn.Module:
    shard = fully_shard()
    alone = _self_contained(model)
    # Shard every block of every ModuleList or ModuleDict (a transformer's layers) as
    # its own unit, so parameters are gathered one block at a time, then the root.
    for block in repeated_blocks(model):
        if (
            any(p.requires_grad for p in block.parameters())
            and not is_fsdp2(block)
            and alone(block)
        ):
            shard(block, **kwargs)
    return cast(nn.Module, shard(model, **kwargs))


def _announce(message: str, *args: object) -> None:
    """Log a decision at INFO on the main process, at DEBUG on the others."""
    (logger.info if is_main_process() else logger.debug)(message, *args)


def _distribute(
    model: nn.Module,
    plan: ParallelPlan,
    facts: ParallelFacts,
    timeout: datetime.timedelta,
    build: MetaBuild | None = None,
) -> nn.Module:
    info: ProcessGroupInfo = ensure_group(
        plan.backend, timeout, facts, plan.device, announce=False, func="parallelize"
    )  # logged once, below
    dev = plan.device
    was_on = _devices_of(model)
    try:
        if dev.type == "cuda" and current_cuda_index() != dev.index:
            torch.cuda.set_device(dev)
        if build is None:
            model.to(dev)
        elif plan.strategy == "ddp":  # allocated whole, the same on every rank
            build.run("parallelize", model, dev)
        if plan.strategy == "fsdp":
            wrapped = _shard(model, plan.wrapper_kwargs)
            if build is not None:  # sharded on meta: only this rank's shards allocated
                build.run("parallelize", wrapped, dev, plan.wrapper_kwargs)
        else:
            wrapped = nn.parallel.DistributedDataParallel(model, **plan.wrapper_kwargs)
            remember(wrapped)  # to name the parameters of DDP's unused-parameter error
    except Exception as exc:
        # A refused call leaves the model where it was and no group behind it.
        try:
            undone = _undo_move(model, was_on, dev)
        finally:  # whatever the move back did, the group this call started goes
            if info.created:
                teardown_owned_group()
        if info.created:
            undone += " The process group this call started was destroyed."
        raise _refused(exc, plan.strategy, undone) from exc
    _announce(
        "cudakit: parallelize(strategy=%r) -> %s on %s (rank %d of %d, backend %s, %s)",
        plan.request,
        plan.strategy.upper(),
        dev,
        group_rank(),
        group_world_size(),
        info.backend,
        f"process group created, timeout {int(info.timeout.total_seconds())}s"
        if info.created
        else "existing process group",
    )
    return wrapped


def _replicate(model: nn.Module, plan: ParallelPlan) -> nn.Module:
    if plan.ignored:
        _announce("cudakit: parallelize(): DDP options %s ignored (DataParallel)", plan.ignored)
    ids = list(plan.device_ids or ())
    model = model.to(plan.device)
    _announce(
        "cudakit: parallelize(strategy=%r) -> DataParallel over cuda:%s. Hint: DDP is "
        "faster and DataParallel is in maintenance mode upstream; launch with "
        "`torchrun --nproc-per-node %d script.py` and parallelize() picks DDP.",
        plan.request,
        ",".join(map(str, ids)),
        len(ids),
    )
    return nn.DataParallel(model, device_ids=ids, **plan.wrapper_kwargs)


def _move(
    model: nn.Module, plan: ParallelPlan, facts: ParallelFacts, build: MetaBuild | None = None
) -> nn.Module:
    if plan.ignored:
        _announce("cudakit: parallelize(): DDP options %s ignored (single device)", plan.ignored)
    dev = plan.device
    if build is not None:
        build.run("parallelize", model, dev)
    model = model.to(dev)
    reason = "" if facts.device_count < 2 or dev.type != "cuda" else " (as requested)"
    _announce("cudakit: parallelize(strategy=%r) -> single device %s%s", plan.request, dev, reason)
    return model


def parallelize(
    model: nn.Module,
    strategy: str = "auto",
    device: DeviceLike = None,
    *,
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    recompute: str | Recompute | None = None,
    init: Callable[..., object] | None = None,
    init_seed: int = 0,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Move ``model`` to this process's device and wrap it for data parallelism; log the choice.

    >>> import torch, cudakit.parallel as cp
    >>> net = cp.parallelize(torch.nn.Linear(4, 2), device="cpu")  # one CPU process
    >>> type(net).__name__  # nothing to wrap
    'Linear'

    The strategy comes from :func:`choose_strategy`: under ``torchrun`` DDP
    (initialising the process group from the environment if needed: ``nccl`` on
    CUDA, ``gloo`` on the CPU, a finite timeout, ``set_device(LOCAL_RANK)`` first);
    one process with several GPUs DataParallel (with a logged hint that DDP is
    faster); otherwise the model is just moved. ``strategy="dp"`` on a CPU is an
    error; under ``"auto"`` a CPU-only process gets the plain model back (the
    documented pass-through). A model that is already wrapped is returned as it is
    (its options still checked against its wrapper; another wrapper is refused).

    ``strategy="fsdp"`` shards with FSDP2 (``fully_shard``): each block of every
    ``nn.ModuleList`` or ``nn.ModuleDict`` (a transformer's layers) becomes its own
    unit, then the root; containers inside a block (adapters, experts) stay part of
    their block.

    A model built on the meta device (``with torch.device("meta"):``) is sharded
    before it exists: only this rank's shards are allocated, then initialised by
    :func:`materialize`'s rules (the same values at any world size). Under DDP or on
    one device it is allocated whole on the device, then initialised.

    Args:
        model: the module to train.
        strategy: ``"auto"``, ``"none"``, ``"dp"``, ``"ddp"`` or ``"fsdp"``.
        device: ``None`` picks ``cuda:LOCAL_RANK`` (or the best device outside a
            launcher); anything :func:`~cudakit.device.resolve_device` accepts.
        backend: process-group backend when one must be created (default from the device).
        timeout: collective timeout in seconds or a ``timedelta`` (default 600 s).
        recompute: activation recompute, applied before wrapping: a policy name
            (``"full"``, ``"selective"``, ...) or a :class:`Recompute`; see
            :func:`~cudakit.parallel.recompute`. None leaves the model as it is.
        init: for a model built on the meta device, what initialises each submodule:
            ``init(module)`` or ``init(module, name)``; None calls each one's own
            ``reset_parameters()``, or a Hugging Face model's ``_init_weights``
            (see :func:`materialize`).
        init_seed: the seed of that init; the same seed gives the same model at
            any world size.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (or to ``fully_shard``
            for ``"fsdp"``, to ``DataParallel`` for an explicit ``"dp"``). Under
            ``"auto"`` they are ignored, with a log line, when no DDP is chosen (their
            names are still checked against ``DistributedDataParallel``).

    Returns:
        The model, moved and possibly wrapped; use ``unwrap`` to get yours back.

    Every argument is checked before anything happens: a refused call leaves the
    model where it was and starts no process group. If the wrapper itself refuses
    an option passed through, the group this call started is destroyed again and
    the model moved back; the error keeps the wrapper's type and names it.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``strategy``, ``device``,
            ``backend`` or ``timeout`` of the wrong kind; unknown keyword arguments.
        ValueError: an unknown strategy or backend, a timeout that is not a finite
            positive duration, a model only partly on the meta device (or one there
            under DataParallel, or tensors its init leaves untouched), a model with
            no trainable parameters for DDP, or an already wrapped model asked for
            another wrapper.
        DeviceError: ``"dp"`` without CUDA, or a device that does not exist.
        DistributedSetupError: ``"ddp"``/``"fsdp"`` without a launcher, or an
            incomplete launcher environment.

    .. versionadded:: 0.1
    """
    obj: object = model
    if not isinstance(obj, nn.Module):
        opt = isinstance(obj, torch.optim.Optimizer)
        hint = "Pass the model, not the optimizer. " if opt else ""
        fail_type(
            "parallelize",
            "model",
            "an nn.Module",
            obj,
            f"{hint}For example: model = parallelize(MyNet()).",
        )
    request = check_strategy(strategy)
    td = check_timeout("parallelize", timeout)
    seed = check_init("parallelize", init, init_seed)
    backend = check_backend("parallelize", backend)
    facts = gather_facts(device, strict_env=request in ("ddp", "fsdp"), func="parallelize")
    spec = as_recompute("parallelize", "recompute", recompute)
    plan = choose_plan_for(request, facts, backend=backend, options=ddp_kwargs, func="parallelize")
    blocks = [] if spec is None else plan_recompute("parallelize", unwrap(model), spec)
    kind = _wrapped_kind(model)
    if kind is not None:
        # A wrapped model is no reason to accept typos, nor a second wrapper.
        _check_wrapped(model, kind, request, ddp_kwargs)
        logger.info(
            "cudakit: parallelize(): model is already %s; returned as is", type(model).__name__
        )
        if spec is not None:
            apply_recompute(unwrap(model), spec, blocks)
        return model
    build = plan_build("parallelize", model, init, seed, plan.device)
    _check_plan(model, plan, build)
    if spec is not None:  # before the wrapper: FSDP2's hooks go around the recomputed forward
        apply_recompute(model, spec, blocks)
    if plan.strategy in ("ddp", "fsdp"):
        try:
            return _distribute(model, plan, facts, td, build)
        except Exception:
            if spec is not None:
                apply_recompute(model, Recompute("none"), [])
            raise
    if plan.strategy == "dp":
        return _replicate(model, plan)
    return _move(model, plan, facts, build)
