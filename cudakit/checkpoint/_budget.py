"""A run budgeted in optimizer steps: ``for batch in ckpt.batches(steps=N)``.

nanoGPT's ``max_iters`` and torchtitan's ``training.steps`` count optimizer steps, not
epochs. :func:`budgeted` yields the loader's batches epoch after epoch (each epoch as
:meth:`~cudakit.Checkpointer.batches` yields it: resumed mid-epoch, with its sampler's
epoch and RNG) until the run's optimizer steps (``position.windows``, a resumed run's
included) reach the budget, checked between batches after the step has run; then it
saves the last checkpoint and waits for it. A run that has made its steps yields
nothing: started again, it runs no forward or backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .data import Position

__all__ = ["budgeted"]


def budgeted(
    loader: Any,
    steps: int,
    *,
    resume: Callable[[], object],
    position: Callable[[], Position],
    epoch: Callable[[Any, int], Iterator[Any]],
    finish: Callable[[], None],
) -> Iterator[Any]:
    """Yield ``loader``'s batches across epochs until ``steps`` optimizer steps in all.

    The run's parts (a :class:`~cudakit.Checkpointer`'s) are passed in: ``resume()``
    picks the run up, ``position()`` says where it stands, ``epoch(loader, until)``
    yields one epoch's batches and stops once the run has made ``until`` steps, and
    ``finish()`` saves the last checkpoint and waits for it.
    """
    resume()
    while position().windows < steps:
        before = position()
        yield from epoch(loader, steps)
        if position().total == before.total:
            raise ValueError(
                f"Checkpointer.batches(steps={steps}): the loader yielded no batch in epoch "
                f"{before.epoch}, so no step of the {steps} can run. Check that the loader "
                "has data (its dataset, drop_last= with a batch larger than the dataset)."
            )
    finish()
