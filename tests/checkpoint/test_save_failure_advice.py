"""A failed save advises what fits its cause: freeing space only for a full disk or
quota, never for a file another process removed or a directory not writable."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

import cudakit


def _fail_with(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    from torch.distributed.checkpoint import filesystem

    from cudakit.checkpoint import _storage as storage

    def write_item(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(filesystem, "_write_item", write_item)  # where DCP writes itself
    monkeypatch.setattr(storage, "_write_file", write_item)  # where cudakit writes DCP's files


@pytest.mark.parametrize(
    ("exc", "advice"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), "Free space on the disk"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "Free space on the disk"),
        (FileNotFoundError(errno.ENOENT, "No such file or directory"), "another process"),
        (PermissionError(errno.EACCES, "Permission denied"), "may not write in"),
        (RuntimeError("a storage plugin failed"), "Fix the cause above and save again"),
    ],
    ids=["full", "quota", "vanished", "denied", "other"],
)
def test_the_advice_follows_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException, advice: str
) -> None:
    model = torch.nn.Linear(2, 1)
    with cudakit.Checkpointer(tmp_path, model=model, preemption=False) as ckpt:
        first = ckpt.save()
        _fail_with(monkeypatch, exc)
        with pytest.raises(cudakit.CheckpointSaveError) as info:
            ckpt.save()
    message = str(info.value)
    assert advice in message
    assert ("Free space" in message) == (advice == "Free space on the disk")
    assert f"The previous checkpoint {first} is intact" in message
    assert cudakit.find_latest(tmp_path) == first
