"""Wrapping: :func:`parallelize` carries out the plan; :func:`unwrap` and state dicts undo it.

:func:`parallelize` checks its arguments, gathers the facts once
(:func:`~cudakit.parallel.strategy.gather_facts`), lets the pure
:func:`~cudakit.parallel.strategy.choose_plan` decide, then acts: creates the
group if the plan says so, moves the model, wraps it and logs the decision once.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from .._accel import current_cuda_index
from .._blocks import repeated_blocks
from .._check import check_bool
from .._dist import group_rank, group_world_size
from ..device import DeviceLike
from ._args import WRAPPER_NAMES, check_option_names, fully_shard
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
from .unused import remember

__all__ = ["LoadResult", "is_fsdp2", "load_state_dict", "parallelize", "state_dict", "unwrap"]

logger = logging.getLogger("cudakit")


# --------------------------------------------------------------------------- unwrap / state


def _compiled_type() -> type[nn.Module] | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # pragma: no cover - torch without dynamo
        return None
    return cast(type[nn.Module], OptimizedModule)


def _check_module(func: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{func}() expects an nn.Module, got {type(model).__name__}. Pass the model "
            "(the object parallelize() or torch.compile() returned)."
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
    if not isinstance(state, Mapping):
        raise TypeError(
            f"load_state_dict() expects a mapping of parameter names to tensors, got "
            f"{type(state).__name__}. If you saved a whole checkpoint, pass "
            "checkpoint['model'] (or whichever key holds the model's state)."
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


# --------------------------------------------------------------------------- parallelize


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
    unit, then the root.

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
        hint = " Pass the model, not the optimizer." if opt else ""
        raise TypeError(
            f"parallelize() expects an nn.Module, got {type(model).__name__}.{hint} "
            "For example: model = parallelize(MyNet())."
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
