"""Mixed precision: :func:`autocast_step` runs a whole AMP training step for you.

One object owns the parts of a mixed-precision step whose order is easy to get
wrong: ``torch.autocast``, ``GradScaler``, gradient accumulation (DDP's ``no_sync``,
FSDP2's ``set_requires_gradient_sync``), unscale-then-clip, a fused non-finite guard
that keeps bad steps away from the weights and the optimizer state, the schedulers
and clearing the gradients.

The package is built from small parts, each owning its state: ``policy`` (the pure
precision decision), ``guard`` (the non-finite check, its verdict across ranks and
the mailbox that reads it back lazily), ``window`` (the accumulation window and
gradient sync), ``buffers`` (buffer snapshots for skipped steps), ``counters``,
``stepper`` (the one path that finishes a window), ``checkpoint`` (validated state
dicts, saved and loaded), ``misuse`` (what misuse raises), ``options`` and ``ops``,
``step``: the :class:`AutocastStep` that composes
them into the decorator and the explicit form, and ``factory``: :func:`autocast_step`.
What a step watches besides inf/NaN: ``spikes`` (loss-spike skipping), ``locate``
(naming the first producer of an inf/NaN, :func:`find_nonfinite`) and ``watch`` (their
part of the step).
"""

from .factory import autocast_step
from .locate import NonFiniteSource, NonFiniteWarning, find_nonfinite
from .result import Verdict
from .spikes import SpikeRule
from .step import AutocastStep, SteppedFunction, StepResult

__all__ = [
    "AutocastStep",
    "NonFiniteSource",
    "NonFiniteWarning",
    "SpikeRule",
    "StepResult",
    "SteppedFunction",
    "Verdict",
    "autocast_step",
    "find_nonfinite",
]
