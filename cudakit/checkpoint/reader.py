"""Reading a checkpoint back: everything checked first, then applied, or nothing.

:func:`read` checks the manifest and every file's size, the number of models,
optimizers, schedulers and steps, the world size where the data position depends on
it, the rank's host file, and every tensor's name and shape against DCP's metadata;
only then does it load the step and scheduler states, the tensors, the extras and the
loader's own state. What a load can still find wrong after the checks (a data file
whose bytes changed but not its size, optimizer hyper-parameters that differ, an extra
that refuses its state) puts everything back as it was (:class:`_Rollback`: the
tensors from a copy in host memory) and raises :class:`CheckpointError`.
:func:`apply_host` puts the RNG back.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..exceptions import CheckpointError
from ..parallel import unwrap
from . import layout
from .arguments import describe_parts
from .data import generators_of, is_stateful, restore_rng
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

__all__ = ["apply_host", "read"]

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
) -> tuple[dict[str, Any], layout.Manifest]:
    """Check checkpoint ``root`` against ``parts``, then load its tensors, step and
    scheduler states, extras and loader state; returns this rank's host state and the
    manifest.

    Raises:
        CheckpointError: a corrupted or incomplete checkpoint, or one that does not fit,
            naming what differs; nothing of ``parts``, ``extras`` or ``loader`` changed.
    """
    try:
        manifest = layout.read_manifest(root)
    except ValueError as exc:
        raise CheckpointError(f"{_FUNC}: {exc}.") from None
    _check_fits(root, manifest, parts, world)
    host = _read_host(root, manifest, rank)
    tensors, fresh_now = _check_tensors(root, parts)
    rollback: _Rollback | None = None
    try:
        rollback = _Rollback(parts, tensors, extras, loader, fresh_now)
        for obj, state in zip(parts.steps, host["steps"], strict=True):
            obj.load_state_dict(state)
        for obj, state in zip(parts.schedulers, host["schedulers"], strict=True):
            obj.load_state_dict(state)
        _load_tensors(root, tensors, parts, distributed)
        _load_extras(host, extras, loader)
    except BaseException as exc:
        # (DCP's CheckpointException derives from BaseException, not Exception.)
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


class _Rollback:
    """What a load may change, saved so that a load that fails part-way changes nothing.

    The tensors DCP loads into (the parameters, buffers and optimizer state themselves)
    are copied to host memory, so a resume needs no spare device memory; the
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
    ):
        # The state DCP made for optimizers that had none is emptied again on failure
        # (reset_fresh): not copied (for AdamW, two thirds of a resume's state).
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
                if isinstance(t, torch.Tensor)
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


def _read_host(root: Path, manifest: layout.Manifest, rank: int) -> dict[str, Any]:
    own = rank if rank < manifest.world_size else 0
    file = root / layout.rank_file(own)
    try:
        # Host state holds Python and NumPy RNG states: load only checkpoints you trust.
        host = torch.load(file, weights_only=False, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(
            f"{_FUNC}: {file} cannot be read ({type(exc).__name__}: {exc}); the checkpoint "
            "is corrupted. Remove it to resume from the one before."
        ) from None
    if not isinstance(host, dict) or host.get("format") != layout.HOST_FORMAT:
        raise CheckpointError(
            f"{_FUNC}: {file} is not a cudakit rank file of format {layout.HOST_FORMAT}."
        )
    host["own"] = own == rank
    return host


def _check_tensors(root: Path, parts: Parts) -> tuple[dict[str, Any], list[bool]]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    try:
        metadata = FileSystemReader(str(root)).read_metadata()
    except Exception as exc:
        raise CheckpointError(
            f"{_FUNC}: {root}/.metadata cannot be read ({exc}); the checkpoint is corrupted."
        ) from None
    fresh_now = fresh_optimizers(parts)
    tensors = tensor_state(parts)
    problems = mismatch(tensors, metadata)
    if problems:
        reset_fresh(parts, fresh_now)
        raise CheckpointError(
            f"{_FUNC}: {root} does not fit this run's models and optimizers: "
            + "; ".join(problems)
            + ". Load a checkpoint of the same model (and optimizer type)."
        )
    return tensors, fresh_now


def _load_tensors(root: Path, tensors: dict[str, Any], parts: Parts, distributed: bool) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    kwargs: dict[str, Any] = {} if distributed else {"no_dist": True}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        load(tensors, storage_reader=FileSystemReader(str(root)), **kwargs)
    for name, model in parts.models.items():
        set_state_dict(
            unwrap(model),
            parts.optimizers_of(name),
            model_state_dict=tensors["model"][name],
            optim_state_dict=tensors["optim"].get(name, {}),
        )


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
