"""Tensors and Parameters copied to the target of a walk, through its memo.

Also the reference counts the inline paths of :mod:`cudakit._tree.walk` compare
against (:func:`sole_references`).
"""

from __future__ import annotations

import sys
from typing import cast

import torch

from .context import Ctx

__all__ = [
    "SOLE_IN_DICT",
    "SOLE_IN_SEQ",
    "copy_tensor",
    "move_param",
    "move_tensor",
    "sole_references",
]

_Tensor = torch.Tensor


def copy_tensor(t: torch.Tensor, c: Ctx) -> torch.Tensor:
    """Copy one tensor that is not on the target yet (callers checked memo and device)."""
    if c.track:
        c.sync.add(t.device)
    st = c.staging
    if st is None:
        # Passing non_blocking only when it is True keeps the common call cheap.
        new = t.to(c.device, non_blocking=True) if c.nb else t.to(c.device)
    else:
        src = t
        if (
            st.pin
            and t.is_cpu
            and type(t) is _Tensor
            and t.layout is torch.strided
            and not t.is_nested
            and not t.is_pinned()
        ):
            src = t.pin_memory()
        new = src.to(c.device, non_blocking=c.nb)
        st.created.append(new)
    c.memo[id(t)] = new
    c.loose = True  # the inline paths of the walk must look tensors up from now on
    return new


def move_tensor(t: torch.Tensor, c: Ctx) -> torch.Tensor:
    st = c.staging
    if st is not None and not t.is_cpu:
        st.device_tensor_seen()
    if t.device == c.device:
        return t
    hit = c.memo.get(id(t))
    return copy_tensor(t, c) if hit is None else cast(torch.Tensor, hit)


def move_param(p: torch.nn.Parameter, c: Ctx) -> torch.Tensor:
    st = c.staging
    if st is not None and not p.is_cpu:
        st.device_tensor_seen()
    if p.device == c.device:
        return p
    hit = c.memo.get(id(p))
    if hit is not None:
        return cast(torch.Tensor, hit)
    if c.track:
        c.sync.add(p.device)
    # Tensor.to on a Parameter returns a plain non-leaf tensor; rebuild the Parameter
    # (as Module.to does), keeping requires_grad and moving an accumulated .grad along.
    c.loose = True  # a Parameter (and its .grad) in the memo: see copy_tensor
    if type(p).to is not torch.nn.Parameter.to:  # a subclass that moves itself
        moved = p.to(c.device, non_blocking=True) if c.nb else p.to(c.device)
        c.memo[id(p)] = moved
        return moved
    new = torch.nn.Parameter(p.detach().to(c.device, non_blocking=c.nb), p.requires_grad)
    if type(p) is not torch.nn.Parameter:
        new.__class__ = type(p)  # a Parameter subclass stays one
    state = getattr(p, "__dict__", None)
    if state:
        new.__dict__.update(state)  # attributes set on the parameter (tp_rank=...)
    if st is not None:
        st.created.append(new)
    c.memo[id(p)] = new
    if p.grad is not None:
        # Through the memo: a .grad that also appears elsewhere stays one tensor.
        grad = p.grad
        hit = c.memo.get(id(grad))
        new.grad = cast(torch.Tensor, hit) if hit is not None else copy_tensor(grad, c)
    return new


def sole_references() -> tuple[int, int]:
    """``sys.getrefcount`` of a value held by nothing but the container being walked.

    Measured with the very loops of _seq and _dict, so it holds on any Python. The
    inline paths memoise a moved tensor only when it has more references than that:
    a tensor found a second time in the input is held by at least two container
    slots, so it always had more, and one held once (the common case) costs no memo
    write. Lookups still run for every tensor.
    """
    seq = dct = 0
    for v in [object()]:
        seq = sys.getrefcount(v)
    for _k, v in {0: object()}.items():
        dct = sys.getrefcount(v)
    return seq, dct


SOLE_IN_SEQ, SOLE_IN_DICT = sole_references()
