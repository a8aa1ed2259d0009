"""Reading a checkpoint back: everything checked first, then applied, or nothing.

:func:`read` checks the manifest and every file's size, the number of models,
optimizers, schedulers and steps, the world size where the data position depends on
it, the rank's host file, and every tensor's name and shape against DCP's metadata;
only then does it load the step and scheduler states, the tensors, the extras and the
loader's own state. What a load can still find wrong after the checks (a data file
whose bytes changed but not its size, optimizer hyper-parameters that differ, an extra
that refuses its state) puts everything back as it was (:class:`_Rollback`) and raises
:class:`CheckpointError`. On the CPU the tensors are read into new storage
(:class:`_Fresh`), so a failure finds them untouched; the others are put back from a
copy in host memory.
:func:`apply_host` puts the RNG back.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from ..exceptions import CheckpointError
from ..parallel import unwrap
from . import layout, safe_dcp, safe_load
from .arguments import describe_parts
from .data import generators_of, is_stateful, restore_rng
from .safe_load import RefusedCheckpointError
from .state import (
    Parts,
    failure_cause,
    flat_keys,
    fresh_optimizers,
    has_state,
    mismatch,
    reset_fresh,
    tensor_state,
)

__all__ = ["RefusedCheckpointError", "apply_host", "read", "written_before"]

log = logging.getLogger("cudakit.checkpoint")

_FUNC = "Checkpointer.load()"


def read(
    root: Path,
    parts: Parts,
    rank: int,
    world: int,
    distributed: bool,
    *,
    extras: dict[str, Any],
    loader: Any,
    group: Any = None,
    trust: bool = False,
    safe_globals: Sequence[Any] = (),
) -> tuple[dict[str, Any], layout.Manifest]:
    """Check checkpoint ``root`` against ``parts``, then load its tensors, step and
    scheduler states, extras and loader state; returns this rank's host state and the
    manifest.

    Every file is read through the safe loaders (:mod:`.safe_load`, :mod:`.safe_dcp`;
    ``trust``: pickle's full loader). Under a process group (``distributed``; the checks
    agree over ``group``), a check that fails on one rank stops every rank with its
    error, before any of them loads.

    Raises:
        CheckpointError: a corrupted or incomplete checkpoint, or one that does not fit,
            naming what differs; nothing of ``parts``, ``extras`` or ``loader`` changed.
        RefusedCheckpointError: a file holds what the safe loaders refuse.
    """
    problem: CheckpointError | None = None
    try:
        manifest = layout.read_manifest(root)
        _check_fits(root, manifest, parts, world)
        host = _read_host(root, manifest, rank, trust, safe_globals)
        storage = safe_dcp.dcp_reader(root, trust=trust)
        metadata = _read_metadata(root, storage)
    except CheckpointError as exc:
        problem = exc
    except ValueError as exc:  # the manifest's
        problem = CheckpointError(f"{_FUNC}: {exc}.")
    _agree(problem, group, distributed)
    tensors, fresh_now = _check_tensors(root, parts, metadata, group, distributed)
    rollback: _Rollback | None = None
    fresh: _Fresh | None = None
    try:
        fresh = _Fresh(parts, tensors)
        rollback = _Rollback(parts, tensors, extras, loader, fresh_now, fresh.ids)
        for obj, state in zip(parts.steps, host["steps"], strict=True):
            obj.load_state_dict(state)
        for obj, state in zip(parts.schedulers, host["schedulers"], strict=True):
            obj.load_state_dict(state)
        _load_tensors(root, tensors, parts, distributed, trust, safe_globals, fresh, storage)
        _load_extras(host, extras, loader)
        fresh.install(tensors)  # last: nothing can fail after it
    except BaseException as exc:
        # (DCP's CheckpointException derives from BaseException, not Exception.)
        if fresh is not None and fresh.committed:
            raise  # interrupted while the models took their tensors: the load is complete
        failed = rollback.restore() if rollback is not None else None
        reset_fresh(parts, fresh_now)
        if failed is not None:
            raise CheckpointError(
                f"{_FUNC}: loading {root} failed ({failure_cause(exc)}), and putting the run "
                f"back failed too ({failure_cause(failed)}): the models, optimizers, step, "
                "schedulers or extras may be partly loaded. Load another checkpoint, or "
                "start the process again."
            ) from exc
        if isinstance(exc, KeyboardInterrupt | SystemExit | GeneratorExit | CheckpointError):
            raise
        raise CheckpointError(
            f"{_FUNC}: loading {root} failed: {failure_cause(exc)}. Nothing was changed: the "
            "models, optimizers, step, schedulers and extras are as they were. A file "
            "whose contents changed is a corrupted checkpoint (remove it to resume from "
            "the one before); other differences mean it was saved from other objects."
        ) from exc
    reset_fresh(parts, host["fresh"])
    return host, manifest


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


class _Fresh:
    """The tensors a load reads into new storage, so that a failed load needs no copy of
    them: the CPU tensors of optimizer state (FSDP2's shards too) and of models that
    load as ``load_state_dict`` does.

    DCP's read of such a tensor keeps the tensor it read (:meth:`Planner.take
    <cudakit.checkpoint.safe_dcp.safe_planner>`) instead of copying it into the
    state dict's own: the optimizers then take the new tensors (their
    ``load_state_dict`` keeps what it is given), and the models take them at the very
    end (:meth:`install`), after everything that can fail: a plain model's parameters
    and buffers hold them (``tensor.data = new``, the objects themselves stay), an FSDP2
    model's shards are copied into (its parameters' storage is FSDP2's own). Tensors on
    a GPU, tensor hyper-parameters and the state of models with load hooks (other than
    FSDP2's), extra state or a ``_load_from_state_dict`` of their own load in place,
    with a host copy to put back (:class:`_Rollback`).
    """

    def __init__(self, parts: Parts, tensors: dict[str, Any]) -> None:
        #: Each plain model's state: its keys, the tensors they name, and the model's
        #: own parameters and buffers those are the data of.
        self.models: dict[str, list[tuple[str, torch.Tensor, list[torch.Tensor]]]] = {}
        #: Each FSDP2 model's state alike: its shards are copied into.
        self.copies: dict[str, list[tuple[str, torch.Tensor, list[torch.Tensor]]]] = {}
        self.ids: set[int] = set()
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
        for optim_state in tensors["optim"].values():
            for per_param in optim_state.get("state", {}).values():
                values = per_param.values() if isinstance(per_param, dict) else ()
                self.ids.update(id(v) for v in values if _cpu_data(v))

    def install(self, tensors: dict[str, Any]) -> None:
        """Make the models' parameters and buffers hold the new tensors: the plain
        models' all or, should this be interrupted, none; then the FSDP2 models' copied
        in, all of them even if interrupted (the load is complete then)."""
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


class _Rollback:
    """What a load may change, saved so that a load that fails part-way changes nothing.

    The tensors DCP loads into in place (those :class:`_Fresh` leaves out: on a GPU, FSDP2
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
        # the tensors the load reads into new storage (``untouched``, see _Fresh).
        made = {
            name
            for name in tensors["optim"]
            if all(fresh[parts.optimizers.index(o)] for o in parts.optimizers_of(name))
        }
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


def _load_extras(host: dict[str, Any], extras: dict[str, Any], loader: Any) -> None:
    """Put the extras and the loader's own state back, naming an extra that refuses."""
    for name, (kind, value) in host["extras"].items():
        target = extras.get(name)
        if kind == "state" and target is not None:
            try:
                target.load_state_dict(value)
            except Exception as exc:
                raise CheckpointError(
                    f"{_FUNC}: the extra {name!r} ({type(target).__name__}) refused its saved "
                    f"state: {type(exc).__name__}: {exc}. Nothing was changed. Pass the "
                    "object it was saved from (extra={...}), or leave it out."
                ) from exc
        else:
            extras[name] = value
    if loader is not None and is_stateful(loader) and host.get("loader") is not None:
        loader.load_state_dict(host["loader"])


def _check_fits(root: Path, manifest: layout.Manifest, parts: Parts, world: int) -> None:
    here = (tuple(parts.models), len(parts.optimizers), len(parts.schedulers), len(parts.steps))
    there = (manifest.models, manifest.optimizers, manifest.schedulers, manifest.steps)
    if here != there:
        raise CheckpointError(
            f"{_FUNC}: {root} holds models {list(manifest.models)}, "
            f"{manifest.optimizers} optimizer(s), {manifest.schedulers} scheduler(s) and "
            f"{manifest.steps} step(s); this run has {describe_parts(parts)}. Build the "
            "Checkpointer with the same objects the checkpoint was saved from."
        )
    if manifest.world_size != world and manifest.mid_epoch_data:
        raise CheckpointError(
            f"{_FUNC}: {root} was saved mid-epoch (epoch {manifest.epoch}, batch "
            f"{manifest.batch}) by {manifest.world_size} rank(s); its data position cannot "
            f"be resharded to {world} rank(s): each rank's shard of the epoch and its RNG "
            "differ. Resume at the same world size, or from a checkpoint taken at an epoch "
            "boundary (the model and optimizers reshard)."
        )


def _read_host(
    root: Path, manifest: layout.Manifest, rank: int, trust: bool, safe_globals: Sequence[Any]
) -> dict[str, Any]:
    own = rank if rank < manifest.world_size else 0
    file = root / layout.rank_file(own)
    try:
        host = safe_load.load_host(file, trust=trust, safe_globals=safe_globals)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{_FUNC}: {file} cannot be read ({type(exc).__name__}: {exc}); the checkpoint "
            "is corrupted. Remove it to resume from the one before."
        ) from None
    if not _is_host(host):
        raise CheckpointError(
            f"{_FUNC}: {file} is not a cudakit rank file of format {layout.HOST_FORMAT}."
        )
    host["own"] = own == rank
    return dict(host)


def _is_host(host: object) -> bool:
    """Whether a rank file's contents have the fields and kinds a load reads."""
    if not isinstance(host, dict) or host.get("format") not in (1, layout.HOST_FORMAT):
        return False
    kinds = {
        "position": dict,
        "rng": dict,
        "steps": list,
        "schedulers": list,
        "fresh": list,
        "extras": dict,
    }
    if not all(isinstance(host.get(k), kind) for k, kind in kinds.items()):
        return False
    rng = host["rng"]
    return (
        isinstance(rng.get("cpu"), torch.Tensor)
        and isinstance(rng.get("python"), tuple)
        and all(isinstance(v, tuple) and len(v) == 2 for v in host["extras"].values())
    )


def _read_metadata(root: Path, storage: Any) -> Any:
    """DCP's metadata of ``root``, read by ``storage`` (:func:`safe_dcp.dcp_reader`),
    which keeps it for the load."""
    try:
        return storage.read_metadata()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{_FUNC}: {root}/.metadata cannot be read ({type(exc).__name__}: {exc}); the "
            "checkpoint is corrupted."
        ) from None


def _agree(problem: CheckpointError | None, group: Any, distributed: bool) -> None:
    """Raise the first rank's failed check on every rank (one rank alone: its own).

    A collective under a process group: every rank calls it once per check, failed or
    not, so no rank goes on into DCP's collectives while another has stopped.
    """
    if not distributed:
        if problem is not None:
            raise problem
        return
    import torch.distributed as dist

    mine = None
    if problem is not None:
        refused = isinstance(problem, safe_load.RefusedCheckpointError)
        fields = (getattr(problem, "file", ""), list(getattr(problem, "refused", ())))
        mine = (refused, str(problem), *fields)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    for r, item in enumerate(gathered):
        if item is None:
            continue
        refused, message, file, names = item
        text = f"{message} (found by rank {r}; every rank stopped before loading)"
        if refused:
            raise safe_load.RefusedCheckpointError(text, file=file, refused=names) from None
        raise CheckpointError(text) from None


def _check_tensors(
    root: Path, parts: Parts, metadata: Any, group: Any, distributed: bool
) -> tuple[dict[str, Any], list[bool]]:
    fresh_now = fresh_optimizers(parts)
    tensors = tensor_state(parts)
    problems = mismatch(tensors, metadata)
    problem = None
    if problems:
        reset_fresh(parts, fresh_now)
        problem = CheckpointError(
            f"{_FUNC}: {root} does not fit this run's models and optimizers: "
            + "; ".join(problems)
            + ". Load a checkpoint of the same model (and optimizer type)."
        )
    try:
        _agree(problem, group, distributed)
    except CheckpointError:
        reset_fresh(parts, fresh_now)
        raise
    return tensors, fresh_now


def _load_tensors(
    root: Path,
    tensors: dict[str, Any],
    parts: Parts,
    distributed: bool,
    trust: bool,
    safe_globals: Sequence[Any],
    fresh: _Fresh,
    storage: Any,
) -> None:
    """DCP's load, then the optimizers' state (and the models' that :class:`_Fresh`
    does not copy at the end) put into the objects."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict, set_state_dict

    safe_dcp.dcp_load(
        tensors,
        root,
        distributed=distributed,
        trust=trust,
        safe_globals=safe_globals,
        reader=storage,
        fresh=fresh.ids,
    )
    for name, model in parts.models.items():
        optimizers = parts.optimizers_of(name)
        if name not in fresh.models and name not in fresh.copies:
            set_state_dict(
                unwrap(model),
                optimizers,
                model_state_dict=tensors["model"][name],
                optim_state_dict=tensors["optim"].get(name, {}),
            )
        elif optimizers:
            set_optimizer_state_dict(unwrap(model), optimizers, tensors["optim"][name])


def written_before(root: Path, path: Path) -> Path | None:
    """The complete checkpoint of ``root`` written just before ``path`` (None: none)."""
    complete = [p for p, _ in layout.list_checkpoints(root).complete]
    older = complete[: complete.index(path)] if path in complete else []
    return older[-1] if older else None


def apply_host(
    host: dict[str, Any], manifest: layout.Manifest, *, loader: Any, rank: int
) -> dict[str, Any] | None:
    """Put this rank's RNG back; returns the RNG states of the epoch's start (to replay a
    mid-epoch loader), if the rank has them."""
    if not host["own"]:
        log.info(
            "cudakit: rank %d has no RNG state in a checkpoint of %d rank(s); its "
            "generators are left as they are",
            rank,
            manifest.world_size,
        )
        return None
    restore_rng(host["rng"], generators_of(loader) if loader is not None else ())
    epoch_rng: dict[str, Any] | None = host.get("epoch_rng")
    return epoch_rng
