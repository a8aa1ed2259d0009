"""``warmup(reserve=...)``: parse the request and make the CUDA caching allocator hold it."""

from __future__ import annotations

import math
import re

import torch

from .._check import check_int, check_number, fail_type, fail_value, is_int, is_real
from .._oom import is_oom_error
from .._units import format_bytes
from ..exceptions import MemoryReserveError

__all__ = ["ReserveSpec", "parse_reserve", "reserve_cuda"]


#: ``reserve=``: bytes (an int), a fraction of the device's memory (a float in
#: (0, 1]), a size with a unit (``"2GiB"``, ``"500MB"``), or None for no reservation.
ReserveSpec = int | float | str | None

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*|%)\s*$")


def parse_reserve(spec: object) -> tuple[str, float]:
    """``("fraction", f)`` or ``("bytes", n)`` for a ``reserve=`` value; raise on nonsense."""
    fix = (
        'Pass bytes (an int, or a string like "12GiB"), a fraction of total device memory '
        '(a float in (0, 1], or a string like "80%"), or None.'
    )
    if is_int(spec):  # NumPy's too
        nbytes = check_int("warmup", "reserve", spec, minimum=1, fix=f"An int counts bytes. {fix}")
        return "bytes", float(nbytes)
    if is_real(spec):  # a NumPy float too
        share = check_number(
            "warmup",
            "reserve",
            spec,
            positive=True,
            maximum=1.0,
            fix=f"A float is a fraction of total device memory. {fix}",
        )
        return "fraction", share
    if not isinstance(spec, str):
        fail_type("warmup", "reserve", "bytes, a fraction, a size string or None", spec, fix)
    m = _SIZE_RE.match(spec)
    unit = m.group(2).lower() if m else ""
    if m is None or (unit != "%" and unit not in _UNITS):
        fail_value("warmup", "reserve", "a size such as '12GiB' or '80%'", spec, fix)
    value = float(m.group(1))
    if unit == "%":
        if not 0.0 < value <= 100.0:
            fail_value("warmup", "reserve", "a percentage in (0, 100]", spec, fix)
        return "fraction", value / 100.0
    if value * _UNITS[unit] < 1:
        fail_value("warmup", "reserve", "a size of at least 1 byte", spec, fix)
    return "bytes", value * _UNITS[unit]


def reserve_cuda(spec: ReserveSpec, kind: str, value: float, device: torch.device) -> int:
    """Make the caching allocator hold at least the requested bytes; return that target."""
    total = torch.cuda.get_device_properties(device).total_memory
    target = int(value * total) if kind == "fraction" else int(value)
    if target > total:
        raise MemoryReserveError(
            f"reserve={spec!r} asks for {format_bytes(target)}, more than {device} has in total "
            f"({format_bytes(total)}). Nothing was allocated. Ask for less, e.g. reserve='80%'."
        )
    held = torch.cuda.memory_reserved(device)
    need = target - held
    if need <= 0:
        return target
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        possible = (held + free) / total * 100
        raise MemoryReserveError(
            f"reserve={spec!r} asks the caching allocator to hold {format_bytes(target)} on "
            f"{device}; it holds {format_bytes(held)} and the device has only {format_bytes(free)} "
            f"free of {format_bytes(total)} (the CUDA context and other processes use the rest). "
            f"Nothing was allocated. Ask for at most about reserve='{math.floor(possible)}%'."
        )
    # One allocation of `need` bytes may be served from blocks the cache already holds
    # free, growing nothing; so hold each block until the reservation reaches the target
    # (every round either grows it or uses up cached free memory), then free them all.
    blocks: list[torch.Tensor] = []
    try:
        with torch.cuda.device(device):
            while need > 0:
                blocks.append(torch.empty(need, dtype=torch.uint8, device=device))
                need = target - torch.cuda.memory_reserved(device)
        blocks.clear()  # back to the cache, not to the driver
    except Exception as exc:
        blocks.clear()
        if not is_oom_error(exc):
            raise
        raise MemoryReserveError(
            f"reserve={spec!r}: {format_bytes(target - held)} looked free on {device} but "
            "could not be allocated (another process took it, or the address space is "
            "fragmented); the allocator released its free cache while trying. Ask for less."
        ) from None
    return target
