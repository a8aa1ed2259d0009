"""Checkpoints: a run that survives crashes, preemptions and restarts.

:class:`Checkpointer` saves everything the next step depends on (models, optimizers,
the ``autocast_step`` state, schedulers, every rank's RNG, the data position and your
extras) with ``torch.distributed.checkpoint``: each FSDP2 rank writes its own shards,
DDP writes one copy, and a checkpoint loads at another world size. A checkpoint is
complete or absent (a manifest written last, then an atomic rename); ``keep=`` keeps
the newest few; ``async_save=True`` writes in the background on a process group of
its own; SIGTERM/SIGUSR1 save at the next window boundary and exit for a requeue.

:func:`find_latest` names the newest complete checkpoint in a directory, and a
:class:`Position` (what a resume returns) is where the run stands: the next epoch and
batch, and the totals so far.
"""

# The parts: layout (the directory, the manifest, which checkpoints are complete),
# state (the tensor and host parts), data (the data position and RNG), writer
# (synchronous and background writes), reader (a load, checked first) with rollback
# (nothing changes when it fails), safe_load and safe_dcp (the rank files and DCP's,
# read without running what they hold), preemption (signals, agreed across ranks),
# saver (the save side: when, what, and the exit after a stop), resume (the resume
# side: which checkpoint, and loading it), arguments (the door) and checkpointer (the
# object that composes them).

from .checkpointer import Checkpointer
from .data import Position
from .resume import find_latest

__all__ = ["Checkpointer", "Position", "find_latest"]
