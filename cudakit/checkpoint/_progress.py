"""What a save records as the run's progress, and the name it goes under.

A :class:`~cudakit.checkpoint.Checkpointer` counts batches and windows itself inside
``batches()`` and ``maybe_save()``. A loop that brings its own data and calls
``save()`` itself shows it nothing of the kind, so such a save records what can be
known: the optimizer steps the ``step=`` closed (real and skipped ones, read from the
step), or without a step, the saves themselves (1, 2, ...). Either way the checkpoint's
name is that number, so a user finds step N's checkpoint as ``ckpt-<N>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .data import Position

__all__ = ["explicit_save", "windows_closed"]


def windows_closed(steps: Sequence[Any]) -> int:
    """The windows the first step has closed: its optimizer steps, skipped ones too.

    >>> import torch, cudakit
    >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    >>> windows_closed([cudakit.autocast_step(opt)])
    0
    """
    step = steps[0]
    return int(step.steps) + int(step.skipped_steps)


def explicit_save(position: Position, steps: Sequence[Any]) -> Position:
    """The position an explicit ``save()`` records in a loop that showed the
    Checkpointer no batch (neither ``batches()`` nor ``maybe_save()`` counted one).

    With steps, the windows they closed (never fewer than counted already); without,
    one more save. Where batches were counted, the position as it stands.

    >>> explicit_save(Position(), [])
    Position(epoch=0, batch=0, total=0, windows=1)
    >>> explicit_save(Position(0, 3, 3, 3), [])
    Position(epoch=0, batch=3, total=3, windows=3)
    """
    if position.total != 0:
        return position  # counted by batches() or maybe_save()
    if steps:
        return dataclasses.replace(position, windows=max(position.windows, windows_closed(steps)))
    return dataclasses.replace(position, windows=position.windows + 1)
