"""Data loading: :func:`prefetch` batches onto the device, :func:`loader_kwargs` for DataLoaders.

On CUDA, :func:`prefetch` copies the next ``depth`` batches on a side stream from
pinned host memory while the current batch is being computed on, so the copy of
batch ``i + 1`` overlaps the compute of batch ``i`` (the data page draws it to scale):

    copy stream     | copy 1 | copy 2 | copy 3 | copy 4 |
    compute stream           | step 1 | step 2 | step 3 | step 4 |

On every other device it is a plain moving iterator: no threads, no look-ahead,
nothing beyond :func:`~cudakit.device.on_device` per batch.
"""

from .loaders import LoaderKwargs, loader_kwargs
from .prefetcher import Prefetcher, SizedPrefetcher, prefetch

__all__ = [
    "LoaderKwargs",
    "Prefetcher",
    "SizedPrefetcher",
    "loader_kwargs",
    "prefetch",
]
