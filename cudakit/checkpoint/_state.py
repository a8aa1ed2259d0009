"""What a checkpoint holds, gathered from the user's objects and put back into them.

Two parts:

* the *tensor* part, written by ``torch.distributed.checkpoint`` (DCP): every model's
  state dict and its optimizers' state, keyed by parameter names
  (``get_state_dict``), so DCP writes each FSDP2 rank's own shards, writes DDP's
  replicated tensors once, and reshards them at load to any world size;
* each rank's *host* part (``rank-NNNNN.pt``): RNG states, the data position, the
  ``autocast_step`` and scheduler states, the loader's own state and the extras.

:class:`Parts` checks what the user passed once; whether a checkpoint fits the state
to load into is :mod:`~cudakit.checkpoint._fit`'s to say.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._check import check_type
from ..parallel import unwrap
from ._gather import Gather

__all__ = [
    "FreshStepError",
    "Parts",
    "drop_unsaved",
    "epoch_end",
    "failure_cause",
    "fresh_optimizers",
    "has_state",
    "made_state",
    "prefill_fresh",
    "saved_entries",
    "step_marks",
    "tensor_state",
    "warn_open_window",
]


@dataclasses.dataclass
class Parts:
    """The objects one :class:`~cudakit.checkpoint.Checkpointer` saves, checked."""

    models: dict[str, nn.Module]
    # each model's optimizers, in the order the user gave them overall
    optimizers: tuple[torch.optim.Optimizer, ...]
    owner: tuple[str, ...]  # owner[i]: the model whose parameters optimizers[i] steps
    schedulers: tuple[Any, ...]
    steps: tuple[Any, ...]
    extras: dict[str, Any]
    # get_state_dict for each model, its names kept while its structure is the same
    gathers: dict[str, Gather] = dataclasses.field(default_factory=dict, repr=False)

    def optimizers_of(self, name: str) -> list[torch.optim.Optimizer]:
        return [o for o, m in zip(self.optimizers, self.owner, strict=True) if m == name]


def _param_ids(model: nn.Module) -> set[int]:
    return {id(p) for p in model.parameters()}


def assign_owners(
    func: str, models: Mapping[str, nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> tuple[str, ...]:
    """For each optimizer, the one model holding all its parameters (else ValueError)."""
    ids = {name: _param_ids(m) for name, m in models.items()}
    owners: list[str] = []
    for i, opt in enumerate(optimizers):
        params = [id(p) for g in opt.param_groups for p in g["params"]]
        owner = next((name for name, s in ids.items() if all(p in s for p in params)), None)
        if owner is None:
            names = ", ".join(repr(n) for n in models)
            raise ValueError(
                f"{func}(): optimizer {i} ({type(opt).__name__}) steps parameters that are "
                f"not all in one of the models ({names}). Pass the module that owns them in "
                "model= (a dict of several models is fine: model={'G': g, 'D': d})."
            )
        owners.append(owner)
    return tuple(owners)


@contextlib.contextmanager
def _grads_hidden(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """Hide the gradients of optimizers without state, so DCP can initialise the state."""
    hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
    for opt in optimizers:
        if opt.state:
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    hidden.append((p, p.grad))
                    p.grad = None
    try:
        yield
    finally:
        for p, g in hidden:
            p.grad = g


class FreshStepError(Exception):
    """DCP's ``get_state_dict`` failed to step an optimizer without state (LBFGS: its
    step needs a closure) to make its state; the optimizer and its parameters' gradients
    are as they were. The caller names it in its own refusal."""

    def __init__(self, index: int, optimizer: torch.optim.Optimizer, cause: str) -> None:
        super().__init__(f"optimizer {index} ({type(optimizer).__name__}): {cause}")
        #: The optimizer's place among the Checkpointer's, its class name, and the failure.
        self.index = index
        self.kind = type(optimizer).__name__
        self.cause = cause


@contextlib.contextmanager
def _step_undone(parts: Parts, optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """Undo what DCP's ``_init_optim_state`` leaves when an optimizer's step fails: its
    state, the zero learning rate it set, the zero gradients it gave; a failure of that
    step is raised as :class:`FreshStepError`. (Inside :func:`_grads_hidden`, which then
    puts the user's gradients back.)"""
    fresh = [opt for opt in optimizers if not opt.state]
    if not fresh:
        yield
        return
    groups = [[(g, dict(g)) for g in opt.param_groups] for opt in fresh]
    try:
        yield
    except BaseException as exc:
        failed = None
        for opt, saved in zip(fresh, groups, strict=True):
            if failed is None and any(g.get("lr") is not v.get("lr") for g, v in saved):
                failed = opt  # DCP left its learning rate at zero: its step failed
            opt.state.clear()
            for group, items in saved:
                for p in group["params"]:
                    p.grad = None  # (DCP's zero gradients; _grads_hidden puts back the user's)
                group.clear()
                group.update(items)
        stepped = any(
            frame.f_code.co_name == "_init_optim_state"
            for frame, _ in traceback.walk_tb(exc.__traceback__)
        )
        if not stepped or not isinstance(exc, Exception):
            raise
        opt = failed if failed is not None else fresh[0]
        raise FreshStepError(
            parts.optimizers.index(opt), opt, f"{type(exc).__name__}: {exc}"
        ) from exc


def fresh_optimizers(parts: Parts) -> list[bool]:
    """Which optimizers have not stepped yet (no state): DCP would initialise theirs."""
    return [not opt.state for opt in parts.optimizers]


def tensor_state(parts: Parts) -> dict[str, Any]:
    """The DCP part: ``{"model": {name: sd}, "optim": {name: osd}}``.

    Each model's is DCP's ``get_state_dict`` (:class:`.gather.Gather`, which keeps
    the names it works out). ``get_state_dict`` fills an optimizer without state by
    stepping it once with zero gradients and a zero learning rate; the caller undoes
    that with :func:`reset_fresh` once the state is saved or loaded. Where that step
    fails (LBFGS's needs a closure), everything is put back and :class:`FreshStepError`
    raised.
    """
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    for name, model in parts.models.items():
        opts = parts.optimizers_of(name)
        gather = parts.gathers.setdefault(name, Gather())
        with _grads_hidden(opts), _step_undone(parts, opts):
            # Names without DataParallel's, DDP's or torch.compile's prefixes, so that a
            # checkpoint loads into the model however it is wrapped.
            msd, osd = gather(unwrap(model), opts)
        model_sd[name] = msd
        if opts:
            optim_sd[name] = osd
    return {"model": model_sd, "optim": optim_sd}


def prefill_fresh(parts: Parts, metadata: Any, fresh: Sequence[bool]) -> None:
    """Give the optimizers without state the state a checkpoint holds for them, in empty
    tensors of its shapes and dtypes, for the load to fill.

    DCP's ``get_state_dict`` would otherwise make their state by stepping them once with
    zero gradients, which on a large model costs more than the load itself (on 100M
    parameters with AdamW, 2 s against 1 s), and cannot make it for an optimizer whose
    step needs a closure (LBFGS). Only a model's optimizers that all have no state,
    whose parameters are plain tensors (no DTensor) and whose state in the checkpoint
    is under their parameters' names, are filled (nested lists and dicts too); the
    others are left to ``get_state_dict``. :func:`reset_fresh` empties them again when
    the load fails.
    """
    for name, model in parts.models.items():
        opts = parts.optimizers_of(name)
        if opts and all(fresh[parts.optimizers.index(o)] for o in opts):
            states = _saved_states(unwrap(model), opts, metadata, f"optim.{name}.state.")
            if states is not None:
                for opt, state in zip(opts, states, strict=True):
                    opt.state.update(state)


def _saved_states(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    metadata: Any,
    prefix: str,
) -> list[dict[torch.Tensor, dict[str, Any]]] | None:
    """Each optimizer's state as the checkpoint's metadata describes it, in empty tensors
    (a value DCP pickled: None until loaded), nested lists and dicts too (LBFGS's
    history); None where it cannot be told safely."""
    from ._gather import names_of

    names = names_of(model, optimizers)
    if names is None:
        return None
    saved = saved_entries(metadata, prefix)
    states: list[dict[torch.Tensor, dict[str, Any]]] = []
    known: set[str] = set()
    for opt, fqns in zip(optimizers, names.optimizers, strict=True):
        params = [p for g in opt.param_groups for p in g["params"]]
        state: dict[torch.Tensor, dict[str, Any]] = {}
        for p, fqn in zip(params, fqns, strict=True):
            if getattr(p, "device_mesh", None) is not None or type(p) not in _PLAIN_PARAMS:
                return None  # a DTensor: its shards are DCP's to lay out
            entries = saved.get(fqn)
            if entries is None:
                continue  # no state saved for it (it never had a gradient)
            laid = _laid_out(entries, p.device)
            if laid is None:
                return None
            state[p] = laid
            known.add(fqn)
        states.append(state)
    if set(saved) - known:
        return None  # state under other names (other parameters): DCP's way
    return states


def saved_entries(metadata: Any, prefix: str) -> dict[str, dict[tuple[Any, ...], Any]]:
    """The checkpoint's state under ``prefix`` (``optim.<model>.state.``): for each
    parameter's name, each value's path below it (``("exp_avg",)``,
    ``("old_dirs", 0)``) and its metadata.

    The paths are DCP's own (its save's ``planner_data``: a list index is an int, a
    dict key a str). A checkpoint without them is read by its flat names, one level
    below the parameter's name; a nested value then reads as another name.
    """
    mappings = getattr(metadata, "planner_data", None)
    head = tuple(prefix[:-1].split("."))
    saved: dict[str, dict[tuple[Any, ...], Any]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        path = mappings.get(key) if isinstance(mappings, dict) else None
        if isinstance(path, tuple) and len(path) > 4 and path[:3] == head:
            fqn, below = str(path[3]), tuple(path[4:])
        else:
            fqn, _, entry = key[len(prefix) :].rpartition(".")
            below = (entry,)
        saved.setdefault(fqn, {})[below] = meta
    return saved


class _NotLaidOut(Exception):
    """Paths that make no one nested value (a list with gaps, a key twice)."""


def _laid_out(entries: Mapping[tuple[Any, ...], Any], device: torch.device) -> Any:
    """One parameter's state from its values' paths and metadata: empty tensors of the
    saved shapes and dtypes (``step`` in host memory, as a load of the saved state
    leaves it; optimizer.load_state_dict moves it where a capturable or fused one wants
    it, and the rest where the parameter is), None for a pickled value; None where the
    paths make no nested value."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tree: dict[Any, Any] = {}
    try:
        for path, meta in entries.items():
            node = tree
            for part in path[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise _NotLaidOut
            if path[-1] in node:
                raise _NotLaidOut
            node[path[-1]] = (
                torch.empty(
                    tuple(meta.size),
                    dtype=meta.properties.dtype,
                    device="cpu" if path == ("step",) else device,
                )
                if isinstance(meta, TensorStorageMetadata)
                else None
            )
        state = _containers(tree)
    except _NotLaidOut:
        return None
    return state if isinstance(state, dict) and all(isinstance(k, str) for k in state) else None


def _containers(node: Any) -> Any:
    """The nested dicts of :func:`_laid_out` as the lists (int keys) and dicts (str keys)
    they were saved from."""
    if not isinstance(node, dict):
        return node
    keys = list(node)
    if keys and all(type(k) is int for k in keys):
        if sorted(keys) != list(range(len(keys))):
            raise _NotLaidOut
        return [_containers(node[i]) for i in range(len(keys))]
    if not all(type(k) is str for k in keys):
        raise _NotLaidOut
    return {k: _containers(v) for k, v in node.items()}


_PLAIN_PARAMS = (nn.Parameter, torch.Tensor)


def made_state(parts: Parts, fresh: Sequence[bool]) -> set[str]:
    """The models whose optimizers all had no state (a load makes theirs)."""
    return {
        name
        for name in parts.models
        if (opts := parts.optimizers_of(name))
        and all(fresh[parts.optimizers.index(o)] for o in opts)
    }


def drop_unsaved(
    parts: Parts, tensors: dict[str, Any], metadata: Any, fresh: Sequence[bool]
) -> None:
    """Leave out of a load the state DCP made for an optimizer without state where the
    checkpoint has none for that parameter (it had no gradient when saved)."""
    keys = sorted(metadata.state_dict_metadata)
    made = made_state(parts, fresh)
    for name, osd in tensors["optim"].items():
        if name not in made:
            continue
        state = osd.get("state", {})
        for fqn in list(state):
            prefix = f"optim.{name}.state.{fqn}."
            at = bisect.bisect_left(keys, prefix)
            if at == len(keys) or not keys[at].startswith(prefix):
                del state[fqn]


def reset_fresh(parts: Parts, fresh: Sequence[bool]) -> None:
    """Empty the state of the optimizers that had none (see :func:`tensor_state`)."""
    for opt, was_fresh in zip(parts.optimizers, fresh, strict=True):
        if was_fresh:
            opt.state.clear()


def check_extras(func: str, extras: object) -> dict[str, Any]:
    """``extra=``: a mapping of names to objects with ``state_dict`` or plain values."""
    if extras is None:
        return {}
    extras = check_type(
        func,
        "extra",
        extras,
        Mapping,
        expected="a dict of names to objects with state_dict()/load_state_dict() or plain values",
        fix="Pass e.g. extra={'ema': ema, 'best_loss': float('inf')}.",
    )
    for key in extras:
        check_type(
            func,
            "extra",
            key,
            str,
            expected="str names as keys",
            fix="Name each extra, e.g. extra={'ema': ema}.",
        )
    return dict(extras)


def has_state(obj: object) -> bool:
    """Whether an extra is saved by ``state_dict()`` and loaded by ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def extras_state(extras: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """Each extra as ``("state", its state_dict())`` or ``("value", the value)``."""
    out: dict[str, tuple[str, Any]] = {}
    for name, obj in extras.items():
        if has_state(obj):
            out[name] = ("state", obj.state_dict())
        else:
            out[name] = ("value", obj)
    return out


def failure_cause(exc: BaseException) -> str:
    """The first underlying error of a DCP failure (it wraps each rank's)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(failures.items()))
        inner_exc = inner[0] if isinstance(inner, tuple) else inner
        return f"{type(inner_exc).__name__}: {inner_exc} (rank {rank})"
    return f"{type(exc).__name__}: {exc}"


def step_marks(steps: Sequence[Any]) -> tuple[Any, ...]:
    """What every micro-step of ``steps`` changes: the reference to its backward's loss.

    :class:`~cudakit.checkpoint.Checkpointer` compares them with ``is`` to tell whether
    a step ran since a batch was yielded.
    """
    return tuple(s.window.backwarded for s in steps)


def epoch_end(steps: Sequence[Any], last: bool) -> contextlib.AbstractContextManager[Any]:
    """Around the epoch's last batch (``last``): each step's ``last_micro_step()``, so a
    partial window's last micro-step syncs through DDP's or FSDP2's own backward."""
    if not last or not steps:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for s in steps:
        stack.enter_context(s.last_micro_step())
    return stack


def warn_open_window(steps: Sequence[Any], latest: Any) -> None:
    """Log that a run ended inside an accumulation window, so no last checkpoint was saved."""
    step = next(s for s in steps if s.position)
    logging.getLogger("cudakit.checkpoint").warning(
        "cudakit: Checkpointer.epochs(): the run ended with %d of %d micro-batches "
        "in an open accumulation window, so no last checkpoint was saved (a "
        "checkpoint never holds half-accumulated gradients); running the command "
        "again resumes from %s and trains what followed again. Call "
        "train_step.flush() after each epoch's batches (a step on the partial "
        "window), or give each epoch a number of batches that accumulate divides.",
        step.position,
        step.accumulate,
        latest or "the start",
    )
