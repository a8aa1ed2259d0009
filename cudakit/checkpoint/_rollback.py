"""A load that changes nothing when it fails: :class:`Fresh` and :class:`Rollback`.

On the CPU a load reads the tensors into new storage (:class:`Fresh`), so a failure
finds the old ones untouched, and the models take the new ones only at the very end;
everything else a load may change (tensors loaded in place, the optimizers' state and
groups, modules' extra state, the steps, schedulers, extras and the loader's state)
is saved first (:class:`Rollback`), in host memory, to be put back.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from ..parallel import unwrap
from ._fit import flat_keys
from ._state import Parts, has_state, made_state
from .data import is_stateful

__all__ = ["Fresh", "Rollback"]


def _to_host(tree: Any) -> Any:
    """A copy of a state dict with its tensors copied to host memory."""
    if isinstance(tree, torch.Tensor):
        return _local(tree).detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return type(tree)((k, _to_host(v)) for k, v in tree.items())
    if isinstance(tree, list | tuple) and not hasattr(tree, "_fields"):
        return type(tree)(_to_host(v) for v in tree)
    return copy.deepcopy(tree)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's own data: a DTensor's local shard, else the tensor."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


class Fresh:
    """The tensors a load reads into new storage, so that a failed load needs no copy of
    them: the CPU tensors of optimizer state (FSDP2's shards too) and of models that
    load as ``load_state_dict`` does.

    DCP's read of such a tensor keeps the tensor it read (:meth:`Planner.take
    <cudakit.checkpoint._safe_dcp.safe_planner>`) instead of copying it into the
    state dict's own: the optimizers then take the new tensors (their
    ``load_state_dict`` keeps what it is given), and the models take them at the very
    end (:meth:`install`), after everything that can fail: a plain model's parameters
    and buffers hold them (``tensor.data = new``, the objects themselves stay), an FSDP2
    model's shards are copied into (its parameters' storage is FSDP2's own). A model's
    contiguous tensors, and the optimizers' state tensors their ``load_state_dict``
    keeps as given (:func:`_kept_on_load`), whose archives fit a layout the reader
    knows are not read before: the reader reads them into their own memory then
    (``read_later``), as ``load_state_dict`` copies, and no new memory is touched.
    Tensors on a GPU, tensor hyper-parameters and the state of models with load hooks
    (other than FSDP2's), extra state or a ``_load_from_state_dict`` of their own load
    in place, with a host copy to put back (:class:`Rollback`).
    """

    def __init__(self, parts: Parts, tensors: dict[str, Any]) -> None:
        #: Each plain model's state: its keys, the tensors they name, and the model's
        #: own parameters and buffers those are the data of.
        self.models: dict[str, list[tuple[str, torch.Tensor, list[torch.Tensor]]]] = {}
        #: Each FSDP2 model's state alike: its shards are copied into.
        self.copies: dict[str, list[tuple[str, torch.Tensor, list[torch.Tensor]]]] = {}
        self.ids: set[int] = set()
        #: Of those, the models' own contiguous tensors and the optimizers' state
        #: tensors they keep, which the reader may fill in place at the very end
        #: (:meth:`install`) instead: their memory is already there, and new memory
        #: costs its page faults.
        self.later: set[int] = set()
        #: Of those, the optimizers' state tensors, which their optimizers keep.
        self.kept: set[int] = set()
        #: Whether :meth:`install` has begun copying: the load is then complete.
        self.committed = False
        for name, state in tensors["model"].items():
            model = unwrap(parts.models[name])
            owners = _owners(model, state)
            where = self.models
            if owners is None:
                owners, where = _owners(model, state, sharded=True), self.copies
            if owners is not None:
                where[name] = [(k, t, owners[k]) for k, t in state.items()]
                self.ids.update(id(t) for t in state.values())
                self.later.update(id(t) for t in state.values() if _local(t).is_contiguous())
        for name, optim_state in tensors["optim"].items():
            kept = _kept_on_load(parts.optimizers_of(name))
            for per_param in optim_state.get("state", {}).values():
                items = per_param.items() if isinstance(per_param, dict) else ()
                for key, v in items:
                    if _cpu_data(v):
                        self.ids.add(id(v))
                        if key != "step" and id(v) in kept and v.is_contiguous():
                            self.later.add(id(v))
                            self.kept.add(id(v))

    def check_kept(self, optimizers: Sequence[torch.optim.Optimizer], waiting: set[int]) -> None:
        """After the optimizers' load: that each still holds its state tensors the
        reader left to be read in place (``waiting``, by id); else it kept copies of
        their old values, and the load fails, changing nothing.

        Raises:
            RuntimeError: an optimizer holds other tensors.
        """
        held = {
            id(v)
            for opt in optimizers
            for state in opt.state.values()
            for v in (state.values() if isinstance(state, dict) else ())
        }
        if not self.kept & waiting <= held:
            raise RuntimeError(
                "an optimizer's load_state_dict did not keep the state tensors it was "
                "given, which the load reads into place at the end"
            )

    def install(self, tensors: dict[str, Any], read_later: Callable[[], None]) -> None:
        """Make the models' parameters and buffers hold the new tensors: the plain
        models' all or, should this be interrupted, none; then ``read_later`` reads the
        ones left to be read in place, and the FSDP2 models' are copied in, all of them
        even if interrupted or one read fails (the load is complete then; the first
        problem is raised after)."""
        done: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            with torch.no_grad():
                for name, entries in self.models.items():
                    loaded = tensors["model"][name]
                    for key, old, owners in entries:
                        new = loaded[key]
                        if new is old:
                            continue
                        if new.stride() != old.stride():
                            new = torch.empty_strided(old.shape, old.stride()).copy_(new)
                        for owner in owners:
                            done.append((owner, old))
                            owner.data = new
                self.committed = True
        except BaseException:
            for owner, old in reversed(done):
                owner.data = old
            raise
        problem: BaseException | None = None
        try:
            read_later()
        except BaseException as exc:  # (the copies are made first)
            problem = exc
        pending = [
            (_local(owners[0]), _local(tensors["model"][name][key]))
            for name, entries in self.copies.items()
            for key, old, owners in entries
            if tensors["model"][name][key] is not old
        ]
        with torch.no_grad():
            try:
                while pending:
                    live, new = pending[-1]
                    live.copy_(new)
                    pending.pop()
            finally:
                for live, new in pending:  # interrupted: finish, then raise
                    live.copy_(new)
        if problem is not None:
            raise problem


def _kept_on_load(optimizers: Sequence[torch.optim.Optimizer]) -> set[int]:
    """The ids of the state tensors of ``optimizers`` whose ``load_state_dict`` keeps
    that very tensor when given it back: torch's own load, no load hooks, and a tensor
    on its parameter's device (of its dtype, for a floating parameter), which the
    load's ``.to()`` then returns as it is. Those a load may read into their own memory
    at the end (:class:`Fresh`'s ``later``)."""
    kept: set[int] = set()
    for opt in optimizers:
        if (
            type(opt).load_state_dict is not torch.optim.Optimizer.load_state_dict
            or opt._optimizer_load_state_dict_pre_hooks
            or opt._optimizer_load_state_dict_post_hooks
        ):
            continue
        for param, state in opt.state.items():
            for v in state.values() if isinstance(state, dict) else ():
                if (
                    isinstance(param, torch.Tensor)
                    and _plain_cpu(v)
                    and v.device == param.device
                    and (v.dtype == param.dtype or not param.is_floating_point())
                ):
                    kept.add(id(v))
    return kept


def _plain_cpu(t: object) -> bool:
    return type(t) is torch.Tensor and t.device.type == "cpu"


def _cpu_data(t: object) -> bool:
    """A plain CPU tensor, or a DTensor whose local shard is one."""
    return isinstance(t, torch.Tensor) and _plain_cpu(_local(t))


def _owners(
    model: torch.nn.Module, state: dict[str, Any], *, sharded: bool = False
) -> dict[str, list[torch.Tensor]] | None:
    """For each key of ``state``, the model's parameters and buffers whose data it is;
    None where that does not load the model as its ``load_state_dict`` would: a tensor
    that is not a CPU tensor of the model's own, or a module that loads in a way of its
    own (a load hook, extra state, its own ``_load_from_state_dict``). ``sharded``:
    the tensors may be DTensors (their local shards are compared), and FSDP2's own load
    hooks (they reshard before a load and re-pad after one that swaps the storage) are
    allowed."""

    def own_way(hook: Any) -> bool:
        fn = getattr(hook, "hook", hook)  # (a pre-hook is wrapped)
        return not (sharded and getattr(fn, "__module__", "").startswith(_FSDP2))

    if any(
        any(own_way(h) for h in m._load_state_dict_pre_hooks.values())
        or any(own_way(h) for h in m._load_state_dict_post_hooks.values())
        or type(m).set_extra_state is not torch.nn.Module.set_extra_state
        or not type(m)._load_from_state_dict.__module__.startswith("torch.nn.")
        for m in model.modules()
    ):
        return None

    def key(t: torch.Tensor) -> tuple[Any, ...]:
        t = _local(t)
        return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())

    live: dict[tuple[Any, ...], dict[int, torch.Tensor]] = {}
    for _, t in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    ):
        live.setdefault(key(t), {})[id(t)] = t
    owners = {}
    for k, t in state.items():
        fits = _cpu_data(t) if sharded else _plain_cpu(t)
        if not fits or key(t) not in live:
            return None
        owners[k] = list(live[key(t)].values())
    return owners


_FSDP2 = "torch.distributed.fsdp._fully_shard."


class Rollback:
    """What a load may change, saved so that a load that fails part-way changes nothing.

    The tensors DCP loads into in place (those :class:`Fresh` leaves out: on a GPU, FSDP2
    shards) are copied to host memory, so a resume needs no spare device memory; the
    optimizers' state and parameter groups, the steps, schedulers, extras and the
    loader's state are kept as they were.
    """

    def __init__(
        self,
        parts: Parts,
        tensors: dict[str, Any],
        extras: dict[str, Any],
        loader: Any,
        fresh: Sequence[bool],
        untouched: Collection[int] = (),
    ):
        # The state DCP made for optimizers that had none is emptied again on failure
        # (reset_fresh): not copied (for AdamW, two thirds of a resume's state). Nor are
        # the tensors the load reads into new storage (``untouched``, see Fresh).
        made = made_state(parts, fresh)
        kept = {
            "model": tensors["model"],
            "optim": {k: v for k, v in tensors["optim"].items() if k not in made},
        }
        with torch.no_grad():
            self.data = [
                (_local(t), _to_host(t))
                for t in flat_keys(kept).values()
                if isinstance(t, torch.Tensor) and id(t) not in untouched
            ]
            # Tensor hyper-parameters (a tensor lr) go back into the same tensors.
            self.data += [
                (_local(v), _to_host(v))
                for opt in parts.optimizers
                for g in opt.param_groups
                for k, v in g.items()
                if k != "params" and isinstance(v, torch.Tensor)
            ]
        # The optimizers' state and groups: the dicts themselves (a load writes into the
        # per-parameter dicts: plain numbers such as an int step count), and their items.
        self.optimizers = [
            (
                opt,
                opt.state,
                dict(opt.state),
                [(s, copy.copy(dict(s))) for s in opt.state.values()],
                opt.param_groups,
                [(g, dict(g)) for g in opt.param_groups],
            )
            for opt in parts.optimizers
        ]
        # Modules' extra state (get_extra_state/set_extra_state), which a load sets too.
        self.extra_module_state = [
            (m, copy.deepcopy(m.get_extra_state()))
            for model in parts.models.values()
            for m in model.modules()
            if type(m).get_extra_state is not torch.nn.Module.get_extra_state
        ]
        self.steps = [(s, s.state_dict()) for s in parts.steps]
        self.schedulers = [(s, copy.deepcopy(s.state_dict())) for s in parts.schedulers]
        self.extras = extras
        self.extra_values = dict(extras)
        self.extra_states = {
            name: _to_host(obj.state_dict()) for name, obj in extras.items() if has_state(obj)
        }
        self.loader = loader
        self.loader_state = (
            copy.deepcopy(loader.state_dict())
            if loader is not None and is_stateful(loader)
            else None
        )

    def restore(self) -> BaseException | None:
        """Put everything back; the first error a part's restore raised, if any (the
        other parts are put back all the same)."""
        failed: BaseException | None = None

        def attempt(action: Any, *args: Any) -> None:
            nonlocal failed
            try:
                action(*args)
            except Exception as exc:
                failed = failed or exc

        for obj, state in self.steps:
            attempt(obj.load_state_dict, state)
        for obj, state in self.schedulers:
            attempt(obj.load_state_dict, state)
        with torch.no_grad():
            for live, saved in self.data:
                live.copy_(saved)
        for opt, state, items, entries, groups, saved_groups in self.optimizers:
            for entry, saved in entries:
                entry.clear()
                entry.update(saved)
            state.clear()
            state.update(items)
            for group, saved in saved_groups:
                group.clear()
                group.update(saved)
            opt.state = state
            opt.param_groups = groups
        for module, extra in self.extra_module_state:
            attempt(module.set_extra_state, extra)
        self.extras.clear()
        self.extras.update(self.extra_values)
        for name, state in self.extra_states.items():
            attempt(self.extra_values[name].load_state_dict, state)
        if self.loader_state is not None:
            attempt(self.loader.load_state_dict, self.loader_state)
        return failed
