"""``maybe_save()`` keeps counting an own-data loop's batches after a ``batches()``
generator was left open (started, kept in a variable, never finished).

Each batch that ``batches()`` yields is counted there, and the first ``maybe_save()``
after it only checks; every further call counts a batch of the loop's own.
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


def test_an_abandoned_batches_generator_does_not_stop_the_count(tmp_path: Path) -> None:
    _, step = _step()
    loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
    ckpt = cudakit.Checkpointer(tmp_path, step=step, loader=loader, every=100)
    ckpt.resume()
    it = ckpt.batches()
    step(next(it))  # one batch from batches(), then the loop brings its own data
    ckpt.maybe_save()
    assert ckpt.position.total == 1
    for _ in range(3):
        step(torch.randn(2, 4))
        ckpt.maybe_save()
    assert (ckpt.position.total, ckpt.position.windows) == (4, 4)
    ckpt.close()
    del it


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
