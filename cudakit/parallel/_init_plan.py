"""Who initialises what in a model built on the meta device, found before anything exists.

A dry run on the meta device calls each module's init on fresh meta tensors and
watches what it writes. From that, :func:`plan` makes the steps of the real run: one
per module that holds tensors (``reset_parameters()`` or ``init=``), or, for a Hugging
Face model's ``_init_weights``, one per group of modules writing the same tensors
(children first). It also names every tensor that nothing would write, so
:mod:`cudakit.parallel.meta` refuses the model before allocating it, and every tensor
written whole (:class:`~cudakit.parallel._init_watch.Watch`), which the real run
need not fill with NaN nor search for NaN after.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn

from ._init_watch import InitFn, Watch, call_init

__all__ = [
    "Slot",
    "Step",
    "group_slots",
    "plan",
    "quoted",
    "run_steps",
    "run_watched",
    "untouched_error",
]


@dataclasses.dataclass
class Slot:
    """One tensor registered on one module: where it sits and what it is."""

    module: nn.Module
    table: str  # "_parameters" or "_buffers"
    name: str
    fqn: str
    tensor: torch.Tensor
    first: bool  # the first module holding this tensor (a tied one is initialised once)

    @property
    def kind(self) -> str:
        return "parameter" if self.table == "_parameters" else "buffer"

    def get(self) -> Any:
        return getattr(self.module, self.table).get(self.name)

    def put(self, value: torch.Tensor) -> None:
        getattr(self.module, self.table)[self.name] = value


def group_slots(model: nn.Module) -> list[tuple[str, nn.Module, list[Slot]]]:
    """Every module that holds tensors itself, with them, in ``named_modules()`` order."""
    seen: set[int] = set()
    out: list[tuple[str, nn.Module, list[Slot]]] = []
    for mname, module in model.named_modules():
        own: list[Slot] = []
        for table in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, table).items():
                if tensor is None:
                    continue
                fqn = f"{mname}.{name}" if mname else name
                own.append(Slot(module, table, name, fqn, tensor, id(tensor) not in seen))
                seen.add(id(tensor))
        if own:
            out.append((mname, module, own))
    return out


@dataclasses.dataclass
class Step:
    """One init run: the modules it calls, in order, the tensors they write, and the
    names of those the dry run saw written whole."""

    calls: list[tuple[str, nn.Module]]
    slots: list[Slot]
    whole: set[str] = dataclasses.field(default_factory=set)


def _own_steps(
    groups: list[tuple[str, nn.Module, list[Slot]]], whole: Iterable[str] = ()
) -> list[Step]:
    """One step per module that holds tensors: its init writes those, and only those
    (``whole``: the names of the tensors a dry run saw written whole)."""
    names = set(whole)
    return [
        Step([(mname, module)], slots, {s.fqn for s in slots if s.fqn in names})
        for mname, module, slots in groups
    ]


def quoted(names: Iterable[str], limit: int = 8) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# --------------------------------------------------------------------------- the dry run


def _fresh(slot: Slot, device: torch.device | str, fill: bool) -> torch.Tensor:
    """A tensor of the slot's full shape and dtype (NaN where it can hold one)."""
    like = slot.tensor
    if fill and (like.is_floating_point() or like.is_complex()):
        t = torch.full(like.shape, math.nan, dtype=like.dtype, device=device)
    else:
        t = torch.empty(like.shape, dtype=like.dtype, device=device)
    if slot.table == "_parameters":
        return nn.Parameter(t, requires_grad=like.requires_grad)
    return t


def run_watched(
    run: Callable[[], None], handed: dict[int, torch.Tensor]
) -> tuple[set[int], set[int]]:
    """``run()`` under no_grad, watched: the keys of the handed tensors it wrote, and
    of those it wrote whole."""
    versions = {key: t._version for key, t in handed.items()}
    watch = Watch({id(t): t for t in handed.values()})
    with torch.no_grad(), watch:
        run()
    written = {
        key for key, t in handed.items() if id(t) in watch.written or t._version != versions[key]
    }
    whole = watch.whole_at_end()
    return written, {key for key, t in handed.items() if id(t) in whole}


def _written_on_meta(
    call: Any, mname: str, module: nn.Module, slots: list[Slot]
) -> tuple[list[Slot], list[Slot]] | None:
    """The slots ``call(module, mname)`` writes, and those it writes whole, found on
    fresh meta tensors (nothing allocated); None when the init cannot run there (it
    reads values). A slot the init replaces is written, not whole."""
    handed = {i: _fresh(s, "meta", fill=False) for i, s in enumerate(slots)}
    try:
        for i, s in enumerate(slots):
            s.put(handed[i])
        try:
            written, whole = run_watched(lambda: call(module, mname), handed)
        except Exception:
            return None  # the real run raises it, with the values at hand
        kept = [slot.get() is handed[i] for i, slot in enumerate(slots)]
        return (
            [s for i, s in enumerate(slots) if not kept[i] or i in written],
            [s for i, s in enumerate(slots) if kept[i] and i in whole],
        )
    finally:
        for s in slots:
            s.put(s.tensor)


def _untouched(steps: list[Step], written: Iterable[Slot]) -> list[str]:
    done = {id(s) for s in written}
    return [
        f"{s.fqn} ({s.kind})" for st in steps for s in st.slots if s.first and id(s) not in done
    ]


def _own_plan(
    groups: list[tuple[str, nn.Module, list[Slot]]], call: Any
) -> tuple[list[Step], list[str] | None]:
    """One step per module, and the tensors the init would not write (None: the init
    cannot run on the meta device)."""
    written: list[Slot] = []
    whole: list[str] = []
    for mname, module, slots in groups:
        wrote = _written_on_meta(call, mname, module, slots)
        if wrote is None:
            return _own_steps(groups), None
        written += wrote[0]
        whole += [s.fqn for s in wrote[1]]
    steps = _own_steps(groups, whole)
    return steps, _untouched(steps, written)


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module once, children before their parent (``named_modules()``'s names)."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def walk(name: str, module: nn.Module) -> None:
        seen.add(id(module))
        for child_name, child in module.named_children():
            if id(child) not in seen:
                walk(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, module))

    walk("", model)
    return out


def _tree_plan(
    model: nn.Module, groups: list[tuple[str, nn.Module, list[Slot]]], call: Any
) -> tuple[list[Step], list[str] | None]:
    """Hugging Face's order: every module, children first, may write tensors of its
    own or of its descendants (GPT-2's attention rescales its projection's weight).
    The dry run finds what each writes; modules writing the same tensors share one
    step, so a rank holds full copies of one step's tensors at a time. A module that
    writes only a tied weight's second name is skipped: the first holder's init wins."""
    found: list[tuple[int, str, nn.Module, list[Slot]]] = []
    written: list[Slot] = []
    whole: set[str] = set()
    for index, (mname, module) in enumerate(_post_order(model)):
        inside = [
            s
            for gname, _, slots in groups
            if not mname or gname == mname or gname.startswith(mname + ".")
            for s in slots
        ]
        if not inside:
            continue
        result = _written_on_meta(call, mname, module, inside)
        if result is None:
            return _own_steps(groups), None
        wrote = result[0]
        if any(s.first for s in wrote):
            found.append((index, mname, module, wrote))
            written += wrote
            whole |= {s.fqn for s in result[1]}
    merged: list[tuple[list[tuple[int, str, nn.Module]], dict[int, Slot]]] = []
    for index, mname, module, wrote in found:
        calls, slots = [(index, mname, module)], {id(s): s for s in wrote}
        keep = []
        for other_calls, other_slots in merged:
            if other_slots.keys() & slots.keys():
                calls, slots = other_calls + calls, {**other_slots, **slots}
            else:
                keep.append((other_calls, other_slots))
        merged = [*keep, (sorted(calls, key=lambda c: c[0]), slots)]
    merged.sort(key=lambda m: m[0][0][0])
    steps = [
        Step(
            [(n, m) for _, n, m in calls],
            list(slots.values()),
            {s.fqn for s in slots.values() if s.fqn in whole},
        )
        for calls, slots in merged
    ]
    return steps, _untouched(_own_steps(groups), written)


def plan(
    model: nn.Module, groups: list[tuple[str, nn.Module, list[Slot]]], init: InitFn | None
) -> tuple[list[Step], list[str] | None, Any]:
    """The steps of the real run, the tensors nothing would write (None: unknown, the
    init cannot run on meta), and the call that initialises one module."""
    if hf_init(model, init):
        call = _hf_call(model, init)
        return (*_tree_plan(model, groups, call), call)
    call = call_init(init)
    return (*_own_plan(groups, call), call)


def run_steps(
    model: nn.Module,
    groups: list[tuple[str, nn.Module, list[Slot]]],
    init: InitFn | None,
    whole: Iterable[str] = (),
) -> tuple[list[Step], Any]:
    """:func:`plan`'s steps and call, without a dry run where the steps do not depend
    on what the init writes (one step per module, ``whole`` the names of the tensors
    an earlier dry run saw written whole); Hugging Face's grouping needs one."""
    if hf_init(model, init):
        call = _hf_call(model, init)
        return _tree_plan(model, groups, call)[0], call
    return _own_steps(groups, whole), call_init(init)


def _hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (duck-typed): its
    ``_init_weights(module)`` writes every tensor. Other models' ``_init_weights``
    (nanoGPT's leaves its LayerNorms to torch; some take no argument) are not called."""
    return callable(getattr(module, "_init_weights", None)) and callable(
        getattr(module, "post_init", None)
    )


def hf_init(model: nn.Module, init: InitFn | None) -> bool:
    """Whether the init is a Hugging Face ``_init_weights(module)``: the model's own
    (``init=None`` on a Hugging Face model) or one passed as ``init=``."""
    if init is None:
        return _hf_model(model)
    owner = getattr(init, "__self__", None)
    return isinstance(owner, nn.Module) and getattr(init, "__name__", "") == "_init_weights"


def _hf_call(model: nn.Module, init: InitFn | None) -> Callable[[nn.Module, str], None]:
    """``init(module)``, or with ``init=None`` the ``_init_weights`` of the module's
    nearest ancestor that has one (HF's dispatch to a composite model's parts)."""
    if init is not None:
        return lambda module, name: init(module)
    owners: dict[str, Callable[[nn.Module], None]] = {}
    for name, module in model.named_modules():
        parent = owners.get(name.rpartition(".")[0]) if name else None
        owners[name] = module._init_weights if _hf_model(module) else cast(Any, parent)
    return lambda module, name: owners[name](module)


def untouched_error(func: str, model: nn.Module, names: list[str], init: InitFn | None) -> str:
    fix = (
        "Give each module a reset_parameters() that writes every tensor it holds itself "
        "(recompute non-persistent buffers such as RoPE's inv_freq there), or pass "
        "init=fn, called as fn(module) or fn(module, name) for every submodule, that does."
    )
    if hf_init(model, init):
        how = f"{type(model).__name__}._init_weights() writes none of"
        fix = (
            "Write them in _init_weights(module) (it is called for every submodule, "
            "children first), or pass init=fn, called as fn(module) or fn(module, name) "
            "for every submodule, that does."
        )
    elif init is not None:
        how = "init=... writes"
    else:
        how = "no reset_parameters() writes (the default init=None calls each module's own)"
    return (
        f"{func}(): {how} {len(names)} tensor(s) of the {type(model).__name__}, which would "
        f"stay uninitialised: {quoted(names)}. {fix}"
    )
