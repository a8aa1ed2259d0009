"""A model built on the meta device, allocated and initialised: the same at any world size.

:func:`materialize` takes a model whose tensors are all on the meta device (built
under ``with torch.device("meta"):``), sharded with FSDP2 or not, allocates it on a
device (for a sharded model only this rank's shards) and initialises it one
submodule at a time:

1. a dry run on the meta device (``_init_plan``) names every tensor the init would
   leave untouched, before anything is allocated;
2. ``model.to_empty(device=...)``, tied weights tied again;
3. for each submodule that owns tensors, in ``model.named_modules()`` order: its full
   tensors are handed to it (for a sharded one, a full copy of each, unless this
   rank's shard is the whole tensor), the init runs under the seed
   :func:`~cudakit.parallel._init_watch.module_seed` derives from ``init_seed`` and
   the module's name, and a sharded tensor keeps the rows of its own shard. The full
   copies go before the next module: a rank holds its shards plus one module's
   tensors at most.

So the gathered parameters equal bit for bit those of the same init on one process,
whatever the world size.

No element is left unwritten: a floating-point tensor is filled with NaN before the
init and searched for NaN after, unless the dry run saw it written whole and the real
run confirms it (:class:`~cudakit.parallel._init_watch.Watch`). When the real run
does not confirm what the dry run saw, the module's tensors are filled and its init
runs again, under the same seed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

from .._check import check_callable, check_int, check_type, fail_type
from ._init_plan import (
    Slot,
    Step,
    group_slots,
    plan,
    quoted,
    run_steps,
    run_watched,
    untouched_error,
)
from ._init_watch import InitFn, module_seed, seeded, whole_model_init

__all__ = ["materialize", "meta_model_state"]


class InitError(ValueError):
    """An init that went wrong on the allocated model: passed through parallelize() as is."""


_INIT = "a callable init(module) or init(module, name), or None for reset_parameters()"


def _dtensor_type() -> type | None:
    mod = sys.modules.get("torch.distributed.tensor")
    return cast("type | None", getattr(mod, "DTensor", None)) if mod is not None else None


def is_sharded(tensor: torch.Tensor) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def meta_model_state(model: nn.Module) -> tuple[list[str], list[str]]:
    """The names of the model's tensors on the meta device, and of those elsewhere."""
    on_meta: list[str] = []
    elsewhere: list[str] = []
    for kind in (model.named_parameters(), model.named_buffers()):
        for name, tensor in kind:
            (on_meta if tensor.is_meta else elsewhere).append(name)
    return on_meta, elsewhere


def check_all_meta(func: str, model: nn.Module) -> bool:
    """Whether every tensor of ``model`` is on the meta device; a model only partly
    there is a ``ValueError``. A model without tensors is not on the meta device."""
    on_meta, elsewhere = meta_model_state(model)
    if on_meta and elsewhere:
        raise ValueError(
            f"{func}() got a {type(model).__name__} only partly on the meta device: "
            f"{quoted(on_meta)} on meta, {quoted(elsewhere)} elsewhere. Build the whole "
            "model under `with torch.device('meta'):` (cudakit allocates and initialises "
            "it), or none of it."
        )
    return bool(on_meta)


# --------------------------------------------------------------------------- allocation


def params_device(options: Mapping[str, Any], device: torch.device) -> torch.device:
    """Where a sharded model's parameters live: the CPU under FSDP2's
    ``offload_policy=CPUOffloadPolicy()``, else ``device`` (its buffers stay there)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    offload = getattr(fsdp, "CPUOffloadPolicy", None) if fsdp is not None else None
    policy = options.get("offload_policy")
    return torch.device("cpu") if offload is not None and isinstance(policy, offload) else device


def _allocate(
    model: nn.Module,
    groups: list[tuple[str, nn.Module, list[Slot]]],
    dev: Any,
    params_on: Any = None,
) -> None:
    """``to_empty(device=dev)`` (parameters on ``params_on`` if given), then every
    tied tensor one object again."""
    model.to_empty(device=params_on if params_on is not None else dev)
    if params_on is not None and torch.device(params_on) != torch.device(dev):
        for _, _, slots in groups:
            for s in slots:
                if s.first and s.table == "_buffers":
                    s.put(torch.empty_like(s.get(), device=dev))
    first: dict[int, Slot] = {}
    for _, _, slots in groups:
        for s in slots:
            if s.first:
                first[id(s.tensor)] = s
    for _, _, slots in groups:
        for s in slots:
            if not s.first:
                s.put(first[id(s.tensor)].get())
    for _, _, slots in groups:  # the objects the slots now hold
        for s in slots:
            s.tensor = s.get()


def _local_rows(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The region of the full tensor that this rank's shard of ``tensor`` holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dt: Any = tensor
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    if is_sharded(tensor):
        return cast(torch.Tensor, cast(Any, tensor).to_local())
    return tensor


def local_region(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The slices of the full tensor this rank holds; None for an unsharded one."""
    return _local_rows(tensor) if is_sharded(tensor) else None


def _nan_able(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _poison(tensor: torch.Tensor) -> None:
    """Fill ``tensor`` with NaN: an element the init leaves unwritten stays NaN."""
    with torch.no_grad():
        tensor.fill_(math.nan)


def _holes(value: torch.Tensor) -> bool:
    """Whether a NaN is left: a sum first (one read, no mask), exact only if it is NaN
    (a tensor holding both infinities sums to NaN too)."""
    if not (value.is_floating_point() or value.is_complex()):
        return False
    wide = torch.float64 if value.dtype == torch.float64 else torch.float32
    total = value.sum(dtype=wide) if value.is_floating_point() else value.sum()
    return bool(torch.isnan(total)) and bool(torch.isnan(value).any())


_ALIGN = 64


def _whole_shard(slot: Slot) -> bool:
    """Whether this rank's shard of a sharded tensor is all of it (one rank): the init
    writes into the shard itself, the same draw as into a full copy."""
    if not is_sharded(slot.tensor):
        return False
    local = local_part(slot.tensor)
    return local.shape == slot.tensor.shape and local.is_contiguous()


def _scratched(slot: Slot) -> bool:
    """Whether the init gets a scratch copy of this tensor: a sharded one (the full
    tensor, rows kept after) unless its shard is all of it, or a tied one met again
    (written, then dropped)."""
    return not slot.first or (is_sharded(slot.tensor) and not _whole_shard(slot))


class _Scratch:
    """One byte buffer per device for the full tensors a module's init gets, reused
    from module to module: allocated (and its pages touched) once, not per module."""

    def __init__(self, steps: list[Step]) -> None:
        self.size = max(
            (sum(self._bytes(s) for s in st.slots if _scratched(s)) for st in steps), default=0
        )
        self.buffers: dict[torch.device, torch.Tensor] = {}

    @staticmethod
    def _bytes(slot: Slot) -> int:
        n = slot.tensor.numel() * slot.tensor.element_size()
        return -(-n // _ALIGN) * _ALIGN

    def handed(self, slots: list[Slot], scratched: list[bool]) -> dict[int, torch.Tensor]:
        """Full tensors for the scratched slots among ``slots``, by index (as they are:
        the caller fills those it searches after)."""
        out: dict[int, torch.Tensor] = {}
        offsets: dict[torch.device, int] = {}
        for i, s in enumerate(slots):
            if not scratched[i]:
                continue
            like = s.tensor
            device = local_part(like).device
            buf = self.buffers.get(device)
            if buf is None:
                buf = self.buffers[device] = torch.empty(
                    self.size, dtype=torch.uint8, device=device
                )
            offset = offsets.get(device, 0)
            n = like.numel() * like.element_size()
            t = buf[offset : offset + n].view(like.dtype).view(like.shape)
            offsets[device] = offset + self._bytes(s)
            out[i] = _as_slot(s, t)
        return out


def _as_slot(slot: Slot, t: torch.Tensor) -> torch.Tensor:
    """``t`` as the slot holds it: a Parameter for a parameter."""
    if slot.table == "_parameters":
        return nn.Parameter(t, requires_grad=slot.tensor.requires_grad)
    return t


def _run_step(
    step: Step, call: Any, handed: dict[int, torch.Tensor], seed: int, device: torch.device
) -> tuple[set[int], set[int]]:
    """The step's inits, each under its own seed, on the handed tensors: the indexes
    of those written, and of those written whole."""
    for i, s in enumerate(step.slots):
        s.put(handed[i])
    written: set[int] = set()
    whole: set[int] = set()
    for mname, module in step.calls:
        with seeded(module_seed(seed, mname), device):
            wrote, all_of = run_watched(functools.partial(call, module, mname), handed)
        written |= wrote
        whole |= all_of
    return written, whole


def _initialise(
    func: str, steps: list[Step], call: Any, init_seed: int
) -> tuple[list[str], list[str]]:
    """The real run; returns the tensors left untouched and those left on meta."""
    untouched: list[str] = []
    on_meta: list[str] = []
    scratch = _Scratch(steps)
    for step in steps:
        slots = step.slots
        scratched = [_scratched(s) for s in slots]
        handed = scratch.handed(slots, scratched)
        device = torch.device("cpu")
        for i, s in enumerate(slots):
            if scratched[i]:  # a full copy; a tied one met again is dropped after
                device = local_part(s.tensor).device
            elif is_sharded(s.tensor):  # the shard is the whole tensor: written in place
                handed[i] = _as_slot(s, local_part(s.tensor))
                device = handed[i].device
            else:
                handed[i] = s.tensor
                device = s.tensor.device
        # The tensors searched for NaN after: those the dry run did not see written whole.
        nan_able = [s.first and _nan_able(s.tensor) for s in slots]
        filled = {i for i, s in enumerate(slots) if nan_able[i] and s.fqn not in step.whole}
        for i in filled:
            _poison(handed[i])
        try:
            written, whole = _run_step(step, call, handed, init_seed, device)
            if any(
                nan_able[i] and i not in filled and i not in whole and s.get() is handed[i]
                for i, s in enumerate(slots)
            ):  # the dry run saw a whole write the real run did not make: again, filled
                filled = {i for i in range(len(slots)) if nan_able[i]}
                for i in filled:
                    _poison(handed[i])
                written, whole = _run_step(step, call, handed, init_seed, device)
            for i, s in enumerate(slots):
                if not s.first:
                    continue
                now = s.get()
                replaced = now is not handed[i]
                if not isinstance(now, torch.Tensor) or now.is_meta:
                    on_meta.append(f"{s.fqn} ({s.kind})")
                    continue
                if now.shape != s.tensor.shape:
                    raise InitError(
                        f"{func}(): the init replaced {s.fqn!r} with a tensor of shape "
                        f"{tuple(now.shape)}, but the model's is {tuple(s.tensor.shape)}. "
                        "Write the values into the tensor the module holds (e.g. "
                        "nn.init.normal_(module.weight)) instead of assigning a new one."
                    )
                if nan_able[i]:
                    bad = (replaced or i not in whole) and _holes(now)
                else:
                    bad = not (replaced or i in written)
                if bad:
                    untouched.append(f"{s.fqn} ({s.kind})")
                    continue
                with torch.no_grad():
                    if scratched[i]:  # a first slot scratched is sharded: keep its rows
                        region = local_region(s.tensor)
                        local_part(s.tensor).copy_(now[region] if region is not None else now)
                    elif replaced:
                        local_part(s.tensor).copy_(now)
        finally:
            for s in slots:
                s.put(s.tensor)
    return untouched, on_meta


def _meta_error(func: str, model: nn.Module, names: list[str]) -> str:
    return (
        f"{func}(): the init left {len(names)} tensor(s) of the {type(model).__name__} on "
        f"the meta device: {quoted(names)}. Write the values into the tensor the module "
        "holds (nn.init.normal_(module.weight)); a tensor made inside the init must be "
        "made on the tensor's device (device=module.weight.device)."
    )


def materialize_checked(
    func: str, model: nn.Module, device: Any, init: InitFn | None, init_seed: int
) -> nn.Module:
    """:func:`materialize` after the arguments were checked (``model`` all on meta)."""
    groups = group_slots(model)
    steps, untouched, call = plan(model, groups, init)
    if untouched:
        raise ValueError(untouched_error(func, model, untouched, init))
    _allocate(model, groups, device)
    untouched, on_meta = _initialise(func, steps, call, init_seed)
    if on_meta:
        raise ValueError(_meta_error(func, model, on_meta))
    if untouched:
        raise ValueError(untouched_error(func, model, untouched, init))
    return model


def check_init(func: str, init: object, init_seed: object) -> int:
    """``init`` callable or None, ``init_seed`` an int >= 0; returns the seed."""
    if init is not None:
        check_callable(
            func, "init", init, expected=_INIT, fix="For example: init=model._init_weights."
        )
        if whole_model_init(init):
            owner = type(cast(Any, init).__self__).__name__
            name = getattr(init, "__name__", "init")
            fail_type(
                func,
                "init",
                _INIT,
                init,
                f"{owner}.{name}() takes no module: it initialises the whole {owner}, but "
                "the init is called once per module, one module at a time, so that a rank "
                "holds its shards and one module's full tensors. Pass a function that "
                "initialises the one module it gets, with the call your "
                f"{name}() makes for that module (docs/big-models.md, torchtitan).",
            )
    return check_int(func, "init_seed", init_seed, minimum=0)


def materialize(
    model: nn.Module,
    device: Any = None,
    *,
    init: Callable[..., object] | None = None,
    init_seed: int = 0,
) -> nn.Module:
    """Allocate a model built on the meta device and initialise it, one module at a time.

    >>> import torch, cudakit.parallel as cp
    >>> with torch.device("meta"):
    ...     net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> net = cp.materialize(net, "cpu", init_seed=1)
    >>> net[0].weight.device, bool(net[1].weight.eq(1).all())
    (device(type='cpu'), True)

    Each submodule that holds tensors itself is initialised by ``init(module)``
    (or ``init(module, name)``, with its name in the model), or by its own
    ``reset_parameters()`` when ``init`` is None (a Hugging Face model: its
    ``_init_weights(module)``, for every submodule, children first), under a seed
    derived from ``init_seed`` and its name. A model sharded with FSDP2
    (``fully_shard``) on the meta device allocates only this rank's shards, and the
    full tensors after the init are the same bit for bit at any world size: those of
    the same call on one process. :func:`parallelize` calls this for a model on the meta device.

    Args:
        model: a module whose parameters and buffers are all on the meta device.
        device: where to allocate it; anything :func:`~cudakit.device.resolve_device`
            takes (``None``: the best device).
        init: writes every tensor a module holds itself; tied weights are written
            by the first module that holds them, non-persistent buffers (RoPE's
            ``inv_freq``) must be recomputed too.
        init_seed: the seed every module's own is derived from.

    Returns:
        ``model``, allocated and initialised.

    Raises:
        TypeError: ``model`` is not a module, ``init`` not callable, ``init_seed``
            not an int.
        ValueError: a model only partly (or not) on the meta device; tensors the
            init would leave untouched (named before anything is allocated), left
            on the meta device, or replaced with another shape.

    .. versionadded:: 0.1
    """
    from ..device import resolve_device

    func = "materialize"
    check_type(func, "model", model, nn.Module, expected="an nn.Module", fix="Pass the model.")
    seed = check_init(func, init, init_seed)
    dev = resolve_device(device)
    if not check_all_meta(func, model):
        raise ValueError(
            f"materialize() got a {type(model).__name__} with no tensor on the meta "
            "device: it is allocated already. Build it under `with torch.device('meta'):`, "
            "or call its init yourself."
        )
    return materialize_checked(func, model, dev, init, seed)


def iter_slots(model: nn.Module) -> Iterator[Slot]:
    """Every (module, tensor) registration of ``model``, tied ones once per module."""
    for _, _, slots in group_slots(model):
        yield from slots


@dataclasses.dataclass(frozen=True)
class MetaBuild:
    """How :func:`~cudakit.parallel.parallelize` builds a model it got on the meta device."""

    init: InitFn | None
    seed: int
    whole: frozenset[str] = frozenset()  # the tensors the dry run saw written whole

    def run(
        self,
        func: str,
        model: nn.Module,
        device: torch.device,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        """Allocate ``model`` (sharded or not) on ``device`` and initialise it; under
        ``fully_shard``'s ``options`` CPU offload, its parameters on the CPU."""
        groups = group_slots(model)
        steps, call = run_steps(model, groups, self.init, self.whole)  # sharded, on meta
        _allocate(model, groups, device, params_device(options or {}, device))
        untouched, on_meta = _initialise(func, steps, call, self.seed)
        if on_meta:
            raise InitError(_meta_error(func, model, on_meta))
        if untouched:
            raise InitError(untouched_error(func, model, untouched, self.init))


def plan_build(
    func: str, model: nn.Module, init: InitFn | None, seed: int, device: torch.device
) -> MetaBuild | None:
    """What to build for a model on the meta device (None for one that is not there, or
    kept there), the tensors its init would leave untouched named before anything."""
    on_meta = check_all_meta(func, model)
    if not on_meta or device.type == "meta":
        if init is not None:
            raise ValueError(
                f"{func}(init=...) initialises a model built on the meta device, but this "
                f"{type(model).__name__} "
                + ("stays on the meta device" if on_meta else "is allocated already")
                + ". Build it under `with torch.device('meta'):` and pass a training "
                "device, or call your init yourself and leave init=None."
            )
        return None
    steps, untouched, _ = plan(model, group_slots(model), init)
    if untouched:
        raise ValueError(untouched_error(func, model, untouched, init))
    return MetaBuild(init, seed, frozenset(name for st in steps for name in st.whole))
