"""``Checkpointer.epochs(stop)`` and ``batches(loader)`` check their arguments when they
are called, as every other function does, not at the first ``next()``; nothing loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import cudakit


def _ckpt(tmp_path: Path, loader: Any = None) -> cudakit.Checkpointer:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, loader=loader,
                                preemption=False)  # fmt: skip


@pytest.mark.parametrize(
    ("stop", "error", "words"),
    [("3", TypeError, "got str '3'"), (2.5, TypeError, "got float"), (-1, ValueError, "-1")],
)
def test_a_bad_stop_raises_at_the_call(
    tmp_path: Path, stop: Any, error: type[Exception], words: str
) -> None:
    with _ckpt(tmp_path) as ckpt:
        with pytest.raises(error, match=r"Checkpointer\.epochs\(stop=") as info:
            ckpt.epochs(stop)  # no next(): the call itself raises
        assert words in str(info.value)
        assert ckpt.resumed_from is None


@pytest.mark.parametrize(
    ("loader", "words"),
    [
        ("data/train", "A path is not a loader"),
        (iter([1, 2]), "An iterator cannot"),
        (None, "Pass the loader to the Checkpointer"),
    ],
)
def test_a_bad_loader_raises_at_the_call(tmp_path: Path, loader: Any, words: str) -> None:
    with _ckpt(tmp_path) as ckpt, pytest.raises(TypeError, match=r"Checkpointer\.batches\("):
        ckpt.batches(loader)
    with _ckpt(tmp_path) as ckpt, pytest.raises(TypeError) as info:
        ckpt.batches(loader)
    assert words in str(info.value)


def test_good_arguments_still_iterate(tmp_path: Path) -> None:
    loader = torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2)
    with _ckpt(tmp_path, loader) as ckpt:
        seen = [len(x) for _ in ckpt.epochs(1) for x in ckpt.batches()]
    assert seen == [2, 2]
