"""Handlers for the torch objects the walker moves in place: modules and optimizers.

They register themselves with :mod:`cudakit._tree` when this module is imported
(``cudakit.device`` does), ahead of the generic container rules.
"""

from __future__ import annotations

from typing import Any

import torch

from .._tree import Bad, Ctx, add_special, located, move

__all__ = ["moved_in_place"]


def _same_place(t: torch.Tensor, device: torch.device) -> bool:
    d = t.device
    index: int | None = device.index  # typed as int by torch, but None for "mps", "cpu"
    return d == device or (index is None and d.type == device.type)


_IN_PLACE: dict[tuple[torch.device, torch.device], bool] = {}


def moved_in_place(p: torch.Tensor, device: torch.device) -> bool:
    """Whether ``Module.to(device)`` keeps the Parameter object ``p`` (``Module._apply``'s rule).

    It does with ``torch.__future__``'s swap flag, and when the old and new tensors have
    compatible types (CPU and CUDA: ``param.data`` is swapped); not for ``meta`` or when
    the overwrite flag is set, where the module gets a new Parameter.
    """
    if torch.__future__.get_swap_module_params_on_conversion():
        return True
    if type(p) is not torch.nn.Parameter or (
        torch.__future__.get_overwrite_module_params_on_conversion()
    ):
        return False
    key = (p.device, device)
    kept = _IN_PLACE.get(key)
    if kept is None:
        probe = torch.empty(0, dtype=p.dtype, device=device)
        kept = _IN_PLACE[key] = bool(torch._has_compatible_shallow_copy_type(p, probe))
    return kept


def _module(m: torch.nn.Module, c: Ctx) -> Any:
    if id(m) in c.memo:
        return m
    c.memo[id(m)] = m
    device = c.device
    needs_move = False
    sources: set[torch.device] = set()
    for kind, named in (("parameter", m.named_parameters()), ("buffer", m.named_buffers())):
        for name, t in named:
            if t.is_meta and device.type != "meta":
                raise Bad(
                    ValueError,
                    f"on_device() cannot move the {type(m).__name__} at {{where}} to "
                    f"{device}: its {kind} {name!r} is on the meta device and holds no data "
                    f"to copy. Allocate the module with `module.to_empty(device={str(device)!r})`"
                    ", then initialise or load its weights (e.g. "
                    "`module.load_state_dict(state_dict, assign=True)`).",
                )
            if not _same_place(t, device):
                needs_move = True
                sources.add(t.device)
                if kind == "parameter" and moved_in_place(t, device):
                    # Module.to keeps this Parameter object: the same tensor found
                    # elsewhere in the input after the module is shared, not copied.
                    c.memo.setdefault(id(t), t)
                    c.loose = True
    if needs_move:
        nb = c.nb
        if c.track:
            c.sync.update(sources)

        def move_module() -> None:
            m.to(device, non_blocking=nb)

        c.defer(move_module)
    return m


def _optimizer(opt: torch.optim.Optimizer, c: Ctx) -> Any:
    if id(opt) in c.memo:
        return opt
    c.memo[id(opt)] = opt
    # torch keeps a scalar `step` on the CPU unless the param group is capturable or fused,
    # in which case it must live with the parameters (Optimizer.load_state_dict's policy).
    on_device_step: set[int] = set()
    for group in opt.param_groups:
        if group.get("capturable", False) or group.get("fused", False):
            on_device_step.update(id(p) for p in group["params"])
    # (holder, key, moved value): holder[key] = value once the whole walk succeeded.
    updates: list[tuple[Any, Any, Any]] = []
    for p, state in opt.state.items():
        if not isinstance(state, dict):
            # Per-parameter state of another kind (a dataclass, a tuple) is walked whole
            # and replaced in opt.state.
            try:
                new_state = move(state, c)
            except (Bad, NotImplementedError) as e:
                raise located(e, f".state[<param {tuple(p.shape)}>]", id(opt), c) from None
            if new_state is not state:
                updates.append((opt.state, p, new_state))
            continue
        for k, v in state.items():
            if k == "step" and isinstance(v, torch.Tensor) and id(p) not in on_device_step:
                continue
            try:
                nv = move(v, c)
            except (Bad, NotImplementedError) as e:
                raise located(e, f".state[<param {tuple(p.shape)}>][{k!r}]", id(opt), c) from None
            if nv is not v:
                updates.append((state, k, nv))
    if updates:

        def move_state() -> None:
            for holder, k, nv in updates:
                holder[k] = nv

        c.defer(move_state)
    return opt


add_special(torch.nn.Module, _module)
add_special(torch.optim.Optimizer, _optimizer)
