"""The ranks of a run as the checkpointer sees them: this one, how many, and a group of its own."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from typing import Any

from .._dist import group_rank, group_world_size, is_group_running

__all__ = ["Ranks"]


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's rank and the world size when the checkpointer was made, and its
    control group (None in one process): gloo, so that neither the agreements on what
    to save and resume nor a background save share training's communicator."""

    rank: int
    world: int
    distributed: bool
    control: Any
    save_group: Any  # a background save's own group (None: none, or one process)

    @classmethod
    def join(cls, *, background: bool) -> Ranks:
        """The ranks now; under a process group, made by every rank together, in order."""
        if not is_group_running():
            return cls(group_rank(), group_world_size(), False, None, None)
        import torch.distributed as dist

        control = dist.new_group(backend="gloo")
        save_group = dist.new_group(backend="gloo") if background else None
        return cls(group_rank(), group_world_size(), True, control, save_group)

    def exit_together(self) -> None:
        """Wait for every rank at an exit they agreed on (a stop signal's), so that none
        destroys its groups while a peer still finishes its last collective: gloo then
        aborts that process ("terminate called without an active exception"). Bounded:
        a rank that never comes (it died) lets the others exit after two minutes."""
        if self.control is None:
            return
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.monitored_barrier(group=self.control, timeout=_EXIT_WAIT, wait_all_ranks=True)


#: How long ranks that agreed to stop wait for each other before they exit (rank 0 may
#: first run ``scontrol requeue``, itself bounded at one minute).
_EXIT_WAIT = datetime.timedelta(seconds=120)
