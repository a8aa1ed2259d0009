"""FLOP formulas for :func:`~cudakit.speed.count_flops`: model FLOPs, the recomputed ones aside.

MFU is defined on model FLOPs (PaLM, appendix B): the maths the model needs, once.
Torch's counter counts hardware FLOPs instead: a fused attention's backward counts
the scores it recomputes (one ``q @ k^T`` per attention), and a forward rerun inside
the backward (``torch.utils.checkpoint``) counts again. :class:`Formulas` gives the
counter every formula it knows, each returning the model's share, and keeps the
recomputed share aside, so the same model counts the same whatever kernel runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import flop_counter

__all__ = ["Formulas"]

#: The id of the backward running on this thread (-1 outside one).
_graph_task: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _cpu_attention(
    query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any
) -> int:
    return int(flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape))


def _cpu_attention_backward(
    grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *a: Any, **k: Any
) -> int:
    return int(
        flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)
    )


def _scores(query_shape: Any, key_shape: Any) -> int:
    """FLOPs of ``q @ k^T`` (shapes ``(batch, heads, seq, dim)``): what a fused backward redoes."""
    b, heads, s_q, dim = query_shape
    return 2 * int(b) * int(heads) * int(s_q) * int(key_shape[2]) * int(dim)


def _sdpa_rescored(grad_out: Any, query: Any, key: Any, *args: Any, **kwargs: Any) -> int:
    return _scores(query.shape, key.shape)


def _reads_kernel_layout(op: Any) -> bool:
    """Whether torch's counter reads the op's dense 4-D inputs as the kernel lays them
    out, ``(batch, seq, heads, dim)``, not as SDPA's ``(batch, heads, seq, dim)``.

    torch 2.15's formula for ``_flash_attention_backward`` does; older ones do not.
    """
    formula = flop_counter.flop_registry.get(op)
    if formula is None:
        return False
    t = torch.empty(1, 2, 3, 4, device="meta")
    try:
        counted = int(formula(t, t, t, t, None, None, None, None, 3, 3, out_val=None))
    except Exception:
        return False
    return counted != int(flop_counter.sdpa_backward_flop_count(t.shape, t.shape, t.shape, t.shape))


def _nested_rescored(
    unpack: str, names: tuple[str, ...], kernel_layout: bool
) -> Callable[..., int] | None:
    """The recomputed scores of torch's varlen kernels, by torch's own shape unpacking
    (and, where torch's counter does, its reading of the kernel's layout)."""
    unpacker = getattr(flop_counter, unpack, None)
    if unpacker is None:
        return None

    def rescored(
        grad_out: Any, query: Any, key: Any, value: Any, _a: Any, _b: Any, *args: Any, **k: Any
    ) -> int:
        if kernel_layout and args[0] is None and query.ndim == 4:
            query, key, value = (t.transpose(-2, -3) for t in (query, key, value))
            grad_out = None if grad_out is None else grad_out.transpose(-2, -3)
        lengths = dict(zip(names, args[:4], strict=True))
        shapes = unpacker(query=query, key=key, value=value, grad_out=grad_out, **lengths)
        return sum(_scores(q, k) for q, k, _v, _g in shapes)

    return rescored


def _rescored() -> dict[Any, Callable[..., int]]:
    """Per attention backward op: the FLOPs of the scores it recomputes, from its arguments."""
    aten = torch.ops.aten
    out: dict[Any, Callable[..., int]] = {}
    for name in (
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    ):
        op = getattr(aten, name, None)
        if op is not None:
            out[op] = _sdpa_rescored
    for name, unpack, lengths in (
        (
            "_flash_attention_backward",
            "_unpack_flash_attention_nested_shapes",
            ("cum_seq_q", "cum_seq_k", "max_q", "max_k"),
        ),
        (
            "_efficient_attention_backward",
            "_unpack_efficient_attention_nested_shapes",
            ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
        ),
    ):
        op = getattr(aten, name, None)
        if op is None:
            continue
        rescored = _nested_rescored(unpack, lengths, _reads_kernel_layout(op))
        if rescored is not None:
            out[op] = rescored
    return out


def _registry() -> dict[Any, Any]:
    """Torch's formulas (each taking the op's arguments), with the CPU's fused attention."""
    aten = torch.ops.aten
    out = dict(flop_counter.flop_registry)
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_attention),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_attention_backward),
    ):
        op = getattr(aten, name, None)
        if op is not None and op not in out:
            out[op] = flop_counter.shape_wrapper(formula)
    return out


class Formulas:
    """The formulas of one count: each gives torch's counter the model FLOPs of an op.

    What the op recomputes goes to :attr:`recomputed` instead: the scores of a fused
    attention's backward, and every op a backward runs with grad enabled (a forward
    rerun by activation checkpointing; a backward with ``create_graph=True`` would
    count there too).
    """

    def __init__(self) -> None:
        #: FLOPs the hardware ran again: hardware FLOPs are the model's plus these.
        self.recomputed = 0

    def mapping(self) -> dict[Any, Any]:
        """``custom_mapping=`` for ``FlopCounterMode``: every known op, model FLOPs only."""
        rescored = _rescored()
        return {op: self._model(f, rescored.get(op)) for op, f in _registry().items()}

    def _model(
        self, formula: Callable[..., int], rescored: Callable[..., int] | None
    ) -> Callable[..., int]:
        def model_flops(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
            flops = int(formula(*args, out_val=out_val, **kwargs))
            if _graph_task() != -1 and torch.is_grad_enabled():
                again = flops  # a forward rerun inside the backward
            elif rescored is not None:
                again = min(flops, rescored(*args, **kwargs))
            else:
                return flops
            self.recomputed += again
            return flops - again

        model_flops._get_raw = True  # type: ignore[attr-defined]  # takes the op's arguments
        return model_flops
