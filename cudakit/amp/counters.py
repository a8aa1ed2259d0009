"""The step's counters: real optimizer steps, skipped ones, and the current streak."""

from __future__ import annotations

import torch

from ..exceptions import NonFiniteStepsError

__all__ = ["StepCounters"]


class StepCounters:
    """Counts of real and skipped optimizer steps; says when a skip streak is too long."""

    __slots__ = ("consecutive", "max_skipped", "skipped", "steps")

    def __init__(self, max_skipped: int) -> None:
        self.max_skipped = max_skipped
        self.steps = 0  # optimizer steps that updated the weights
        self.skipped = 0  # optimizer steps dropped for an inf/NaN loss or gradient
        self.consecutive = 0  # skipped steps since the last real one

    def record_step(self) -> None:
        """A real optimizer step: the streak ends."""
        self.steps += 1
        self.consecutive = 0

    def record_skip(self) -> bool:
        """A skipped step; True when the streak reached ``max_skipped``."""
        self.skipped += 1
        self.consecutive += 1
        return self.consecutive >= self.max_skipped

    def streak_error(self, dtype: torch.dtype) -> NonFiniteStepsError:
        """The error for a streak of ``max_skipped`` skipped steps."""
        return NonFiniteStepsError(
            f"autocast_step skipped {self.consecutive} optimizer steps in a row "
            f"because the loss or gradients were inf/NaN (dtype={dtype}, "
            f"max_skipped={self.max_skipped}); the weights and optimizer state are the "
            "last good ones. Check the data for NaNs, lower the learning rate, set "
            "max_grad_norm=..., or try dtype=torch.bfloat16; raise max_skipped=... if "
            "long streaks are expected."
        )
