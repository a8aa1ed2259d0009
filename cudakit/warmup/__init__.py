"""Warm-up passes that leave no trace, memory reservation, and batch-size search.

The first steps of a CUDA run are slow: the context starts, cuBLAS/cuDNN create
their handles, ``cudnn.benchmark`` autotunes, and the caching allocator grows one
``cudaMalloc`` at a time. :func:`warmup` pays those costs up front on an example
batch and then puts every piece of training state back exactly as it was;
:func:`find_batch_size` finds the largest batch that fits in memory.

Public names:

* :func:`warmup` runs forward/backward passes and returns a :class:`WarmupReport`;
  its ``reserve=`` pre-allocates memory in the CUDA caching allocator.
* :class:`preserve_state` is the no-trace guarantee on its own, as ``with`` or ``@``.
* :func:`warmed` wraps a step function so that its first call is preceded by
  warm-up calls that leave no trace (without the function it returns a
  :class:`WarmedDecorator`).
* :func:`example_batch` takes a warm-up batch from a loader and leaves the RNG as it was.
* :func:`find_batch_size` grows the batch size geometrically, then bisects (without
  ``trial_fn`` it returns a :class:`FindBatchSizeDecorator`); an out-of-memory error
  marks a size as too big.
"""

# Modules: preserve (state rollback), passes (warmup), report, warmed, example
# (example_batch), batch_size; private: _args (shared argument checks), _loss (the two
# forms of loss_fn), _reserve.

from ..exceptions import MemoryReserveError, ReserveIgnoredWarning
from .batch_size import FindBatchSizeDecorator, find_batch_size
from .example import example_batch
from .passes import warmup
from .preserve import preserve_state
from .report import WarmupReport
from .reserve import ReserveSpec
from .warmed import WarmedDecorator, warmed

__all__ = [
    "FindBatchSizeDecorator",
    "MemoryReserveError",
    "ReserveIgnoredWarning",
    "ReserveSpec",
    "WarmedDecorator",
    "WarmupReport",
    "example_batch",
    "find_batch_size",
    "preserve_state",
    "warmed",
    "warmup",
]
