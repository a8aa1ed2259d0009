"""``cudakit demo``: train a small CNN with every cudakit utility in place.

The demo generates a CIFAR-10-shaped data set itself (3x32x32 images, 10 classes,
deterministic for a seed and learnable: each class is a smooth colour pattern seen
through random shifts, contrast and noise), trains a conv-bn-relu network on it for a
few epochs and prints the accuracy on a held-out split. Every utility is used the way
the docs recommend:

* :func:`~cudakit.device.resolve_device` picks the device, :func:`~cudakit.device.on_device`
  moves the loss module and the evaluation data;
* :func:`~cudakit.data.loader_kwargs` sets up the ``DataLoader`` and
  :func:`~cudakit.data.prefetch` copies batches ahead of the compute;
* :func:`~cudakit.warmup.warmup` runs the first passes without leaving a trace, and
  ``--batch-size auto`` uses :func:`~cudakit.warmup.find_batch_size`;
* :func:`~cudakit.amp.autocast_step` does the mixed-precision step with gradient
  accumulation (2), clipping (1.0) and a learning-rate schedule;
* :func:`~cudakit.memory.memory_report` measures every epoch;
* :func:`~cudakit.parallel.parallelize` wraps the model (DDP under ``torchrun`` or
  ``--nprocs N``, which goes through :func:`~cudakit.parallel.launch`).

Run it as ``cudakit demo`` or ``python -m cudakit demo``; ``--help`` lists the options.
Its pieces are importable for experiments of your own: :func:`make_dataset` (the data
set), :func:`make_model` (the network), :func:`main` (the command itself), and
:class:`DemoSummary` and :class:`EpochStats` (what a run reports).
"""

# Modules: data (make_dataset), model (make_model), summary (DemoSummary, EpochStats)
# and command (main).

# Private modules: _args (the command line: parser and the checks made before anything
# runs), _training (the training loop), _evaluation (held-out scoring, sums over ranks),
# _progress (the bar), _plot (the --plot figure).

from .command import main
from .data import make_dataset
from .model import make_model
from .summary import DemoSummary, EpochStats

__all__ = ["DemoSummary", "EpochStats", "main", "make_dataset", "make_model"]
