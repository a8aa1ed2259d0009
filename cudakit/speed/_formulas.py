"""FLOP formulas :func:`~cudakit.speed.count_flops` adds to torch's counter."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import flop_counter

__all__ = ["formulas"]


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


def formulas() -> dict[Any, Any]:
    """FLOP formulas torch's counter lacks: the CPU's fused attention, forward and backward.

    The same formulas torch uses for the CUDA attention kernels (causal attention is
    counted as full attention there too).
    """
    aten = torch.ops.aten
    out: dict[Any, Any] = {}
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_attention),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_attention_backward),
    ):
        op = getattr(aten, name, None)
        if op is not None and op not in flop_counter.flop_registry:
            out[op] = formula
    return out
