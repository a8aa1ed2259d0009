"""Memory statistics around any block: :func:`memory_report` and :func:`memory_snapshot`.

:func:`memory_report` measures a block (``with``) or every call of a function
(``@``): allocated and reserved memory before and after, the peaks *inside* the
block, free and total device memory, and the wall time. On CUDA it reads the
caching allocator; on the CPU it reads the process's resident set size (RSS), so
the same code runs on a laptop. :func:`memory_snapshot` gives the numbers now.
:func:`estimate_memory` predicts every rank's peak before launch, on fake tensors.

Design notes:

* **Never starts CUDA.** Before CUDA is initialised nothing can be allocated on a
  GPU, so a report says "CUDA not started" instead of creating a context.
* **Nesting is safe.** Peak resets are global per device, so every open report
  keeps the peak it saw before each later reset.
* **Threads.** Reports on different threads that overlap on one device are marked
  ``shared=True``.
"""

# Modules: results (the report types and their one renderer), reporter
# (memory_report and its MemoryMeter), snapshot (memory_snapshot), estimate
# (estimate_memory); private: _live (live tensor bytes), _frames
# (the peaks of nested reports), _probes, _targets, _throttle, _notes.

# Private modules: _probes (every read of torch.cuda or /proc; tests replace its
# objects with fakes), _frames (open reports), _targets (device=), _throttle
# (aggregate output), _notes (out-of-memory notes).

from .._deprecated import renamed as _renamed
from .estimate import MemoryEstimate, estimate_memory, largest_batch
from .reporter import MemoryMeter, MemoryReported, memory_report
from .results import DeviceMemory, MemoryReport, MemorySnapshot
from .snapshot import memory_snapshot

__all__ = [
    "DeviceMemory",
    "MemoryEstimate",
    "MemoryMeter",
    "MemoryReport",
    "MemoryReported",
    "MemorySnapshot",
    "estimate_memory",
    "largest_batch",
    "memory_report",
    "memory_snapshot",
]

__getattr__ = _renamed(__name__, {"MemoryReporter": MemoryMeter})
