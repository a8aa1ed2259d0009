"""Reading a checkpoint back: everything checked first, then applied, or nothing.

:func:`read` checks the manifest and every file's size, the number of models,
optimizers, schedulers and steps, the world size where the data position depends on
it, the rank's host file, and every tensor's name and shape against DCP's metadata;
only then does it load the step and scheduler states, the tensors, the extras and the
loader's own state. What a load can still find wrong after the checks (a data file
whose bytes changed but not its size, optimizer hyper-parameters that differ, an extra
that refuses its state) puts everything back as it was and raises
:class:`CheckpointError`: :mod:`~cudakit.checkpoint._rollback` reads the CPU tensors
into new storage (:class:`~cudakit.checkpoint._rollback.Fresh`), so a failure finds
them untouched, and puts the others back from a copy in host memory
(:class:`~cudakit.checkpoint._rollback.Rollback`). The models' own tensors and the
optimizers' state are read into their memory last, once nothing else can fail; a disk
that fails only then is a :class:`CheckpointError` that says they are partly loaded.
:func:`apply_host` puts the RNG back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..exceptions import CheckpointError
from ..parallel import unwrap
from . import _layout as layout
from . import _safe_dcp as safe_dcp
from . import _safe_load as safe_load
from ._args import describe_parts
from ._fit import mismatch, optimizer_mismatch
from ._rollback import Fresh, Rollback
from ._safe_load import RefusedCheckpointError
from ._state import (
    FreshStepError,
    Parts,
    drop_unsaved,
    failure_cause,
    fresh_optimizers,
    prefill_fresh,
    reset_fresh,
    tensor_state,
)
from .data import generators_of, is_stateful, restore_rng

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
    rollback: Rollback | None = None
    fresh: Fresh | None = None
    try:
        fresh = Fresh(parts, tensors)
        rollback = Rollback(parts, tensors, extras, loader, fresh_now, fresh.ids)
        for obj, state in zip(parts.steps, host["steps"], strict=True):
            obj.load_state_dict(state)
        for obj, state in zip(parts.schedulers, host["schedulers"], strict=True):
            obj.load_state_dict(state)
        _load_tensors(root, tensors, parts, distributed, trust, safe_globals, fresh, storage)
        _load_extras(host, extras, loader)
        fresh.install(tensors, lambda: _read_in_place(root, storage))  # last
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
    tensors: dict[str, Any] = {}
    problem = None
    try:
        prefill_fresh(parts, metadata, fresh_now)
        tensors = tensor_state(parts)
    except FreshStepError as exc:
        problem = CheckpointError(
            f"{_FUNC}: optimizer {exc.index} ({exc.kind}) has no state yet, and the state "
            f"{root} holds for it cannot be laid out here (sharded parameters, or state "
            "under other names), so DCP's get_state_dict made it by stepping the optimizer "
            f"once with zero gradients, which failed ({exc.cause}). Nothing was changed: "
            "the optimizer (its learning rate, state and groups) and the model are as "
            "they were. Step it once (optimizer.step(closure) for LBFGS) before loading; "
            "the load then replaces its state and the model's weights."
        )
    if problem is None:
        drop_unsaved(parts, tensors, metadata, fresh_now)
        optimizers = optimizer_mismatch(parts, tensors, metadata)
        explained = [f"optim.{name}." for name in optimizers]
        problems = [p for found in optimizers.values() for p in found]
        problems += mismatch(tensors, metadata, explained=explained)
        if problems:
            fix = (
                "Build each optimizer as the checkpoint's was saved (the same optimizer "
                "type, options and parameter groups), or train this one from the start in "
                "another directory."
                if optimizers
                else "Load a checkpoint of the same model (and optimizer type)."
            )
            problem = CheckpointError(
                f"{_FUNC}: {root} does not fit this run's models and optimizers: "
                + "; ".join(problems)
                + f". {fix}"
            )
    if problem is not None:
        reset_fresh(parts, fresh_now)
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
    fresh: Fresh,
    storage: Any,
) -> None:
    """DCP's load, then the optimizers' state (and the models' that :class:`Fresh`
    does not copy at the end) put into the objects."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # Each optimizer takes what the checkpoint holds: a parameter that had no gradient
    # when saved has no state there, and is left without, as the hand-written loop's
    # optimizer.load_state_dict leaves it (DCP's strict load would refuse it). That
    # every state the optimizer has is in the checkpoint, and every state there is
    # loaded, _check_tensors made sure (optimizer_mismatch).
    lenient = StateDictOptions(strict=False)

    safe_dcp.dcp_load(
        tensors,
        root,
        distributed=distributed,
        trust=trust,
        safe_globals=safe_globals,
        reader=storage,
        fresh=fresh.ids,
        later=fresh.later,
    )
    for name, model in parts.models.items():
        optimizers = parts.optimizers_of(name)
        if name not in fresh.models and name not in fresh.copies:
            set_model_state_dict(unwrap(model), tensors["model"][name])
        if optimizers:
            set_optimizer_state_dict(
                unwrap(model),
                optimizers,
                tensors["optim"][name],
                options=lenient,
            )
    fresh.check_kept(parts.optimizers, storage.tensors.waiting)


def _read_in_place(root: Path, storage: Any) -> None:
    """Read the tensors DCP's load left to be read in place (the models' and the
    optimizers' own), after every check.

    Raises:
        CheckpointError: a data file that can no longer be read (the models are then
            partly loaded: the message says so).
    """
    try:
        storage.tensors.read_later()
    except Exception as exc:
        raise CheckpointError(
            f"{_FUNC}: every check of {root} passed, but reading the models' weights "
            f"and the optimizers' state into place then failed ({failure_cause(exc)}): "
            "the models and optimizers are partly loaded (the steps, schedulers and "
            "extras are loaded). Load a checkpoint again before training on."
        ) from exc


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
