"""The step's counters: real optimizer steps, skipped ones, spikes, and the current streak."""

from __future__ import annotations

import torch

from ..exceptions import NonFiniteStepsError

__all__ = ["StepCounters"]


class StepCounters:
    """Counts of real and skipped optimizer steps; says when a skip streak is too long."""

    __slots__ = (
        "consecutive",
        "consecutive_spikes",
        "max_skipped",
        "skipped",
        "spikes",
        "steps",
        "weighted",
    )

    def __init__(self, max_skipped: int) -> None:
        self.max_skipped = max_skipped
        self.steps = 0  # optimizer steps that updated the weights
        self.skipped = 0  # optimizer steps dropped for an inf/NaN or a loss spike
        self.spikes = 0  # of those, the ones dropped for a loss spike (skip_spikes=)
        self.consecutive = 0  # skipped steps since the last real one
        self.consecutive_spikes = 0  # of those, loss spikes
        # A weight tensor was seen: a negative one skips its window like an inf/NaN.
        self.weighted = False

    def record_step(self) -> None:
        """A real optimizer step: the streak ends."""
        self.steps += 1
        self.consecutive = 0
        self.consecutive_spikes = 0

    def record_skip(self, spike: bool = False) -> bool:
        """A skipped step (``spike``: a loss spike); True once the streak is ``max_skipped``."""
        self.skipped += 1
        self.consecutive += 1
        if spike:
            self.spikes += 1
            self.consecutive_spikes += 1
        return self.consecutive >= self.max_skipped

    def streak_error(self, dtype: torch.dtype) -> NonFiniteStepsError:
        """The error for a streak of ``max_skipped`` skipped steps."""
        spikes = self.consecutive_spikes
        nonfinite = "the loss or gradients were inf/NaN"
        if self.weighted:
            nonfinite += " (or a token weight was negative)"
        if spikes == 0:
            why = f"because {nonfinite}"
        elif spikes == self.consecutive:
            why = "because every window's loss was a spike under skip_spikes="
        else:
            why = f"({spikes} of them loss spikes under skip_spikes=, the rest because {nonfinite})"
        spike_fix = (
            " The spike rule's running statistics learn from accepted windows only, so a "
            "lasting change of level keeps being skipped: loosen SpikeRule(z=..., ratio=...)."
            if spikes
            else ""
        )
        return NonFiniteStepsError(
            f"autocast_step skipped {self.consecutive} optimizer steps in a row "
            f"{why} (dtype={dtype}, max_skipped={self.max_skipped}); the weights and "
            "optimizer state are the last good ones. Check the data for NaNs, lower the "
            "learning rate, set max_grad_norm=..., or try dtype=torch.bfloat16; raise "
            f"max_skipped=... if long streaks are expected.{spike_fix}"
        )
