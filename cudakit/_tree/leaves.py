"""The one table of leaves: values that hold no tensor and come back as themselves."""

from __future__ import annotations

import enum
import functools
import types

import torch

__all__ = [
    "LEAVES",
]

LEAVES: tuple[type, ...] = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    range,
    slice,
    type(Ellipsis),
    enum.Enum,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    functools.partial,
    torch.dtype,
    torch.device,
    torch.Size,
    torch.layout,
    torch.memory_format,
)
