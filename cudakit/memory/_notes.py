"""Notes added to an exception raised inside a report: what to do about an out-of-memory error."""

from __future__ import annotations

import contextlib

from .._units import format_bytes, format_signed_bytes
from . import _probes
from .results import MEMORY_VIZ, MemoryReport

__all__ = ["explain_oom"]


def explain_oom(exc: BaseException, rep: MemoryReport) -> None:
    """Add what the user needs to act on an out-of-memory error, once per device."""
    noted: set[str] = getattr(exc, "_cudakit_memory_noted", set())
    for d in rep.devices:
        if d.device in noted or d.cuda_started is False:
            continue  # an inner report already explained this device
        noted.add(d.device)
        if d.reserved_before is None:
            exc.add_note(
                f"cudakit.memory_report {rep.label or ''!r} on {d.device}: peak RSS "
                f"{format_bytes(d.peak_allocated)} in this block (RSS "
                f"{format_bytes(d.allocated_before)} at its start); available system "
                f"memory {format_bytes(d.free)} of {format_bytes(d.total)}.",
            )
            continue
        try:
            largest = _probes.cuda.largest_free_block(int(d.device.split(":")[1]))
        except Exception:
            largest = None
        cached = (d.reserved_after or 0) - d.allocated_after
        exc.add_note(
            f"cudakit.memory_report {rep.label or ''!r} on {d.device}: peak allocated "
            f"{format_bytes(d.peak_allocated)} in this block "
            f"({format_signed_bytes(d.peak_increase)} over its start); now allocated "
            f"{format_bytes(d.allocated_after)}, reserved "
            f"{format_bytes(d.reserved_after)} ({format_bytes(cached)} cached but unused); "
            f"largest free cached block {format_bytes(largest)}; device free "
            f"{format_bytes(d.free)} of {format_bytes(d.total)}. If cached-but-unused is "
            "large the cache is fragmented: set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. Otherwise lower the batch "
            "size (cudakit.warmup.find_batch_size) or use mixed precision (autocast_step); "
            f"record_history='oom.pickle' shows what held the memory ({MEMORY_VIZ}).",
        )
    with contextlib.suppress(AttributeError, TypeError):
        exc._cudakit_memory_noted = noted  # type: ignore[attr-defined]
