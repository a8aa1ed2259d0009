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

# How it is built. AutocastStep (step.py) is a thin composer: the option checks
# (options.resolve_options) make one frozen StepConfig, handed to every part; each part
# owns its state, and the parts call one another's methods, never their private state.
#
# - options: the checks and StepConfig; policy: the precision decision (pure).
# - window: the window's position and contents, its Stage (closed, open, unsynced) and
#   GradSync (DDP's no_sync, FSDP2's flag); buffers: the buffer snapshot; counters.
# - block: `with step:` and its Turn; microstep: a micro-step's backward into the window;
#   params: the parameters, their gradients, clipping.
# - judge: the verdict on a closing window (guard: the non-finite check; spikes and
#   watch: the spike rule and the replay's record; verdicts read lazily); stepper: the
#   optimizer step on that verdict; ops: the optimizer and device ops.
# - checkpoint: the state, checked whole, then applied; misuse: what misuse raises;
#   locate and values: find_nonfinite's replay; result: StepResult and Verdict;
#   factory: autocast_step.
#
# One decorated call: AutocastStep._run marks the step running (block.ACTIVE);
# MicroSteps.before_forward opens the window (clears the gradients); the forward runs
# under autocast, with gradient sync paused on a micro-step that does not close the
# window; MicroSteps.backward scales and backpropagates; MicroSteps.after_backward counts
# it and hands a full window to OptimizerStep.finish, which unscales, asks WindowJudge
# for the verdict, clips, steps every optimizer and scheduler or none, and closes the
# window. The explicit form does the same between Block.enter (`with step:`) and
# AutocastStep.backward.

from .factory import autocast_step
from .locate import NonFiniteSource, NonFiniteWarning, Phase, find_nonfinite
from .result import Verdict
from .spikes import SpikeRule, Statistic
from .step import AutocastStep, SteppedFunction, StepResult

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
    "autocast_step",
    "find_nonfinite",
]
