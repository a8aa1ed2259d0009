"""``maybe_save()`` inside ``batches()`` only checks, however often it is called for one
batch (a batch split into several steps); a ``batches()`` generator that is left must be
closed (or let go), after which an own-data loop's calls count again.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import cudakit
from cudakit.amp import autocast_step


def _step() -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @autocast_step(opt, model=model, dtype=torch.float32)
    def step(x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), torch.zeros(len(x), 2))

    return model, step


def test_a_closed_batches_generator_does_not_stop_the_count(tmp_path: Path) -> None:
    _, step = _step()
    loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
    ckpt = cudakit.Checkpointer(tmp_path, step=step, loader=loader, every=100)
    ckpt.resume()
    it = ckpt.batches()
    step(next(it))  # one batch from batches(), then the loop brings its own data
    ckpt.maybe_save()
    assert ckpt.position.total == 1
    it.close()
    for _ in range(3):
        step(torch.randn(2, 4))
        ckpt.maybe_save()
    assert (ckpt.position.total, ckpt.position.windows) == (4, 4)
    ckpt.close()


def test_a_generator_closed_late_leaves_the_newer_ones_batch(tmp_path: Path) -> None:
    _, step = _step()
    loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
    ckpt = cudakit.Checkpointer(tmp_path, step=step, loader=loader, every=100)
    ckpt.resume()
    old = ckpt.batches()
    next(old)
    new = ckpt.batches()
    step(next(new))
    old.close()  # the older generator ends now: the newer one's batch is still current
    ckpt.maybe_save()
    assert ckpt.position.total == 2
    new.close()
    ckpt.close()


def test_batches_still_count_once_with_maybe_save_inside(tmp_path: Path) -> None:
    _, step = _step()
    loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
    ckpt = cudakit.Checkpointer(tmp_path, step=step, loader=loader, every=100)
    for _ in ckpt.epochs(2):
        for i, x in enumerate(ckpt.batches()):
            step(x)
            if i % 2:  # maybe_save() on some batches only: still one count per batch
                ckpt.maybe_save()
    assert (ckpt.position.epoch, ckpt.position.total, ckpt.position.windows) == (2, 8, 8)
    ckpt.close()


def test_a_batch_split_into_several_steps_counts_once(tmp_path: Path) -> None:
    """maybe_save() after each chunk of a yielded batch only checks: the batch counted."""
    _, step = _step()
    loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)
    ckpt = cudakit.Checkpointer(tmp_path, step=step, loader=loader, every=100)
    for _ in ckpt.epochs(1):
        for x in ckpt.batches():
            for chunk in x.split(2):
                step(chunk)
                ckpt.maybe_save()
    assert (ckpt.position.total, ckpt.position.windows) == (2, 2)
    ckpt.close()
