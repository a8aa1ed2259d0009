"""Reading a checkpoint back: everything checked first, then applied.

:func:`read` checks the manifest and every file's size, the number of models,
optimizers, schedulers and steps, the world size where the data position depends on
it, the rank's host file, and every tensor's name and shape against DCP's metadata;
only then does it load the step and scheduler states and the tensors (putting the step
and schedulers back if the tensors fail). :func:`apply_host` puts the extras, the
loader's own state and the RNG back.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from ..exceptions import CheckpointError
from ..parallel import unwrap
from . import layout
from .arguments import describe_parts
from .data import generators_of, is_stateful, restore_rng
from .state import Parts, fresh_optimizers, mismatch, reset_fresh, tensor_state

__all__ = ["apply_host", "read"]

log = logging.getLogger("cudakit.checkpoint")

_FUNC = "Checkpointer.load()"


def read(
    root: Path, parts: Parts, rank: int, world: int, distributed: bool
) -> tuple[dict[str, Any], layout.Manifest]:
    """Check checkpoint ``root`` against ``parts``, then load its tensors, step and
    scheduler states into them; returns this rank's host state and the manifest.

    Raises:
        CheckpointError: a corrupted or incomplete checkpoint, or one that does not fit,
            naming what differs; nothing of ``parts`` changed.
    """
    try:
        manifest = layout.read_manifest(root)
    except ValueError as exc:
        raise CheckpointError(f"{_FUNC}: {exc}.") from None
    _check_fits(root, manifest, parts, world)
    host = _read_host(root, manifest, rank)
    tensors, fresh_now = _check_tensors(root, parts)
    steps, scheds = parts.steps, parts.schedulers
    before = [s.state_dict() for s in steps], [s.state_dict() for s in scheds]
    try:
        for obj, state in zip(steps, host["steps"], strict=True):
            obj.load_state_dict(state)
        for obj, state in zip(scheds, host["schedulers"], strict=True):
            obj.load_state_dict(state)
        _load_tensors(root, tensors, parts, distributed)
    except Exception as exc:
        for obj, state in zip(steps, before[0], strict=True):
            obj.load_state_dict(state)
        for obj, state in zip(scheds, before[1], strict=True):
            obj.load_state_dict(state)
        reset_fresh(parts, fresh_now)
        raise CheckpointError(
            f"{_FUNC}: loading {root} failed: {type(exc).__name__}: {exc}"
        ) from exc
    reset_fresh(parts, host["fresh"])
    return host, manifest


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
    host: dict[str, Any],
    manifest: layout.Manifest,
    *,
    extras: dict[str, Any],
    loader: Any,
    rank: int,
) -> dict[str, Any] | None:
    """Put the extras, the loader's own state and this rank's RNG back; returns the RNG
    states of the epoch's start (to replay a mid-epoch loader), if the rank has them."""
    for name, (kind, value) in host["extras"].items():
        target = extras.get(name)
        if kind == "state" and target is not None:
            target.load_state_dict(value)
        else:
            extras[name] = value
    if loader is not None and is_stateful(loader) and host.get("loader") is not None:
        loader.load_state_dict(host["loader"])
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
