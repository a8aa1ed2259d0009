"""Whether a checkpoint fits the state a load would fill, and why not: every tensor's
name, kind and shape against DCP's metadata, and each optimizer's options and state
against what the checkpoint holds for it. Asked before anything is loaded, so a
refusal changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ._state import Parts, saved_entries

__all__ = ["flat_keys", "mismatch", "optimizer_mismatch"]


def _flatten(prefix: str, obj: Any, out: dict[str, Any]) -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(obj, list | tuple) and not isinstance(obj, torch.Size):
        for i, v in enumerate(obj):
            _flatten(f"{prefix}.{i}", v, out)
    else:
        out[prefix] = obj


def flat_keys(state: Mapping[str, Any]) -> dict[str, Any]:
    """DCP's flat names (``model.net.0.weight``) for a nested state dict."""
    out: dict[str, Any] = {}
    _flatten("", state, out)
    return out


def mismatch(
    state: Mapping[str, Any], metadata: Any, *, explained: Sequence[str] = ()
) -> list[str]:
    """What stops ``state`` from loading the checkpoint whose DCP metadata is given.

    Missing keys (this run has them, the checkpoint does not: DCP's strict load needs
    every one, pickled values too), unexpected keys (the checkpoint's model has them,
    this run's does not), values that are a tensor on one side only, and tensors whose
    shapes differ, each named; empty when the
    checkpoint fits. Missing keys under a prefix of ``explained`` (an optimizer that
    :func:`optimizer_mismatch` named) are left out.
    """
    saved = metadata.state_dict_metadata
    flat = flat_keys(state)
    problems: list[str] = []
    mine = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    theirs = {k for k, v in saved.items() if hasattr(v, "size")}
    loaded = _load_keys(state, mine)
    missing = sorted(
        k for k in loaded if k not in saved and not any(k.startswith(p) for p in explained)
    )
    kinds = sorted(
        k
        for k, v in loaded.items()
        if k in saved and isinstance(v, torch.Tensor) != hasattr(saved[k], "size")
    )
    unexpected = sorted(k for k in theirs if k not in flat and k.startswith("model."))
    if missing:
        problems.append(f"missing from the checkpoint: {_names(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in this run: {_names(unexpected)}")
    if kinds:
        problems.append(
            f"a tensor in one and a plain value in the other: {_names(kinds)} (state of "
            "another length, such as LBFGS's history: load into a new optimizer, which "
            "takes the checkpoint's)"
        )
    for key, tensor in mine.items():
        meta = saved.get(key)
        size = getattr(meta, "size", None)
        if size is not None and tuple(size) != tuple(tensor.shape):
            problems.append(
                f"{key} has shape {tuple(size)} in the checkpoint, {tuple(tensor.shape)} here"
            )
    return problems


def _load_keys(state: Mapping[str, Any], tensors: Mapping[str, Any]) -> Mapping[str, Any]:
    """The names DCP's load looks up for ``state`` and their values: its own flattening
    (a list holding no tensor, a tuple, stays one value); the tensors where torch
    moved it."""
    try:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    except ImportError:  # pragma: no cover - a torch that moved it
        return tensors
    flat, _ = flatten_state_dict(dict(state))
    return flat


def optimizer_mismatch(
    parts: Parts, state: Mapping[str, Any], metadata: Any
) -> dict[str, list[str]]:
    """For each model whose optimizers do not fit the checkpoint's, why: per optimizer,
    the options (its parameter groups' keys) and state entries it has that the
    checkpoint's lack, and what the checkpoint holds instead (another optimizer type);
    or another number of parameter groups. DCP's strict load would refuse these with
    its first missing key."""
    found: dict[str, list[str]] = {}
    for name, osd in state.get("optim", {}).items():
        groups = osd.get("param_groups", [])
        saved_options = _saved_options(metadata, name)
        saved_state = saved_entries(metadata, f"optim.{name}.state.")
        opts = parts.optimizers_of(name)
        problems: list[str] = []
        if len(groups) != len(saved_options):
            who = (
                f"optimizer {parts.optimizers.index(opts[0])} ({type(opts[0]).__name__}) "
                f"of model {name!r} has"
                if len(opts) == 1
                else f"the optimizers of model {name!r} have"
            )
            problems.append(
                f"{who} {len(groups)} parameter group(s), the checkpoint's has {len(saved_options)}"
            )
            found[name] = problems
            continue
        start = 0
        for opt in opts:
            count = len(opt.param_groups)
            problem = _optimizer_problem(
                f"optimizer {parts.optimizers.index(opt)} ({type(opt).__name__}) of model {name!r}",
                groups[start : start + count],
                saved_options[start : start + count],
                osd.get("state", {}),
                saved_state,
            )
            start += count
            if problem is not None:
                problems.append(problem)
        if problems:
            found[name] = problems
    return found


def _optimizer_problem(
    who: str,
    groups: Sequence[Mapping[str, Any]],
    saved_groups: Sequence[set[str]],
    state: Mapping[str, Any],
    saved_state: Mapping[str, Mapping[tuple[Any, ...], Any]],
) -> str | None:
    """Why one optimizer's groups and state do not fit the checkpoint's (None: they do):
    the options and state entries it has that the checkpoint's lack, and what the
    checkpoint holds instead."""
    options = {k for g in groups for k in g if k != "params"}
    their_options = set().union(*saved_groups)
    fqns = [fqn for g in groups for fqn in g.get("params", ())]
    entries = {str(k) for fqn in fqns for k in _entries(state.get(fqn))}
    their_entries = {str(path[0]) for fqn in fqns for path in saved_state.get(fqn, ())}
    lacks = _listed((("options", options - their_options), ("state", entries - their_entries)))
    more = their_entries - entries if entries else set()
    unloaded = sorted(f for f in fqns if f in saved_state and not state.get(f))
    if not lacks and unloaded:  # a stepped optimizer: the load fills only what it has
        return (
            f"{who} has no state for {', '.join(unloaded)}, which the checkpoint holds "
            "state for, and a load into it would leave them without (load into a new "
            "optimizer, which takes all of the checkpoint's state)"
        )
    if not lacks and more:  # its state as loaded would miss entries its options use
        return (
            f"{who} keeps the state {', '.join(sorted(entries))}, and the checkpoint holds "
            f"the state {', '.join(sorted(more))} as well, which this optimizer would not "
            "load (it was saved with other options or another optimizer type)"
        )
    if not lacks:
        return None
    holds = _listed((("options", their_options - options), ("state", their_entries)))
    hint = (
        " (an lr scheduler adds initial_lr: build the schedulers as the saved run did)"
        if "initial_lr" in options - their_options
        else ""
    )
    return (
        f"{who} expects the {lacks}, which the checkpoint does not hold; the checkpoint "
        f"holds {'the ' + holds if holds else 'no state for its parameters'}{hint}"
    )


def _listed(kinds: Sequence[tuple[str, set[str]]]) -> str:
    """``options a, b and the state c`` (the kinds with names only)."""
    return " and the ".join(f"{what} {', '.join(sorted(keys))}" for what, keys in kinds if keys)


def _entries(value: Any) -> Iterator[Any]:
    return iter(value) if isinstance(value, Mapping) else iter(())


def _saved_options(metadata: Any, name: str) -> list[set[str]]:
    """The option names of each parameter group the checkpoint holds for model
    ``name``'s optimizers (from DCP's paths, else the flat names)."""
    prefix = f"optim.{name}.param_groups."
    mappings = getattr(metadata, "planner_data", None)
    head = ("optim", name, "param_groups")
    groups: dict[int, set[str]] = {}
    for key in metadata.state_dict_metadata:
        if not key.startswith(prefix):
            continue
        path = mappings.get(key) if isinstance(mappings, dict) else None
        if isinstance(path, tuple) and len(path) > 4 and path[:3] == head:
            index, option = path[3], str(path[4])
        else:
            first, _, rest = key[len(prefix) :].partition(".")
            index, option = (int(first) if first.isdigit() else first), rest.split(".")[0]
        if isinstance(index, int):
            groups.setdefault(index, set())
            if option != "params":
                groups[index].add(option)
    return [groups[i] for i in sorted(groups)]


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
