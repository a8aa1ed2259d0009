"""Mixed precision: :func:`autocast_step` runs a whole AMP training step for you.

One object owns the parts of a mixed-precision step whose order is easy to get
wrong: ``torch.autocast``, ``GradScaler``, gradient accumulation (DDP's ``no_sync``,
FSDP2's ``set_requires_gradient_sync``), unscale-then-clip, a fused non-finite guard
that keeps bad steps away from the weights and the optimizer state, the schedulers
and clearing the gradients.

What it offers:

* :func:`autocast_step` makes an :class:`AutocastStep`: decorate the loss function
  with it (the decorated function is a :class:`SteppedFunction`), or call
  ``step.backward(loss)`` yourself. Every call returns a :class:`StepResult`, whose
  ``stepped`` and ``skipped`` are read lazily (a :class:`Verdict`) on the sync-free path.
* ``skip_spikes=`` (``True``, ``"loss"``, ``"grad_norm"`` or a :class:`SpikeRule`)
  skips a window whose loss or gradient norm jumps, as it skips a non-finite one.
* :func:`find_nonfinite` runs a loss function and its backward once and names the
  first producer of an inf/NaN (a :class:`NonFiniteSource`); with
  ``locate_nonfinite=True`` a step does it for each window it skips and warns with a
  :class:`NonFiniteWarning`.
* ``state_dict()``/``load_state_dict()`` checkpoint the step (the scaler, the
  accumulation position, the counters), so a resumed run continues bit for bit.
* ``cudakit.amp.policy`` holds the precision decision, a pure function of the device's
  capabilities (:func:`~cudakit.amp.policy.decide_precision`).
"""

# The parts, each owning its state: policy (the pure precision decision), guard (the
# non-finite check, its verdict across ranks and the mailbox that reads it back
# lazily), window (the accumulation window and gradient sync), buffers (buffer
# snapshots for skipped steps), counters, stepper (the one path that finishes a
# window), checkpoint (validated state dicts), misuse (what misuse raises), options
# and ops; step (AutocastStep, composing them into the decorator and the explicit
# form) and factory (autocast_step). Besides inf/NaN a step watches: spikes
# (loss-spike skipping), locate (find_nonfinite, with values: the inf/NaN check of
# nested inputs and the batch copies of its replay) and watch (their part of the step).

from .factory import autocast_step
from .locate import NonFiniteSource, NonFiniteWarning, Phase, find_nonfinite
from .result import Verdict
from .spikes import SpikeRule, Statistic
from .step import AutocastStep, SteppedFunction, StepResult
from .watch import WatchOptions

__all__ = [
    "AutocastStep",
    "NonFiniteSource",
    "NonFiniteWarning",
    "Phase",
    "SpikeRule",
    "Statistic",
    "StepResult",
    "SteppedFunction",
    "Verdict",
    "WatchOptions",
    "autocast_step",
    "find_nonfinite",
]
