"""``keep=`` removes an old checkpoint whole or not at all, and says when it could not.

A removal that fails part-way (a file another process holds, a permission) used to
leave a checkpoint with files missing under its name, which every later resume
warned about as corrupted, while the log said it was removed.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import cudakit
from cudakit.checkpoint import _layout as layout


class _Run:
    """A loop whose Checkpointer keeps one checkpoint; entering resumes, ``save()`` steps first."""

    def __init__(self, tmp_path: Path) -> None:
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        self.step = cudakit.autocast_step(opt, model=model, dtype=torch.float32)(
            lambda x: model(x).pow(2).mean()
        )
        self.ckpt = cudakit.Checkpointer(tmp_path, step=self.step, keep=1, preemption=False)

    def __enter__(self) -> _Run:
        self.ckpt.resume()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ckpt.close()

    def save(self) -> Path | None:
        self.step(torch.ones(3, 2))
        self.ckpt.maybe_save()
        return self.ckpt.save()


def test_a_removal_that_fails_part_way_leaves_no_broken_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = shutil.rmtree

    def failing(path: Any, *args: Any, **kwargs: Any) -> None:
        if not str(path).endswith(".removing"):
            return real(path, *args, **kwargs)
        files = sorted(Path(path).iterdir())
        files[0].unlink()  # one file goes, then the rest refuses
        raise PermissionError(13, "Permission denied", str(files[1]))

    with _Run(tmp_path) as ckpt:
        first = ckpt.save()
        monkeypatch.setattr(layout.shutil, "rmtree", failing)
        with caplog.at_level(logging.WARNING, logger="cudakit"):
            second = ckpt.save()
            ckpt.ckpt.wait()  # (the removal runs beside the loop)
        monkeypatch.setattr(layout.shutil, "rmtree", real)
    assert first is not None
    assert second is not None
    assert "could not remove" in caplog.text
    assert first.name in caplog.text
    assert "Permission denied" in caplog.text
    found = layout.list_checkpoints(tmp_path)
    assert [p.name for p, _ in found.complete] == [second.name]
    assert found.broken == ()
    assert cudakit.find_latest(tmp_path) == second  # no warning about a corrupted one


def test_what_a_failed_removal_left_is_cleared_at_the_next_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = shutil.rmtree

    def refusing(path: Any, *args: Any, **kwargs: Any) -> None:
        if not str(path).endswith(".removing"):
            return real(path, *args, **kwargs)
        raise PermissionError(13, "Permission denied", str(path))

    with _Run(tmp_path) as ckpt:
        ckpt.save()
        monkeypatch.setattr(layout.shutil, "rmtree", refusing)
        ckpt.save()
    monkeypatch.undo()
    assert any(p.name.endswith(".removing") for p in tmp_path.iterdir())
    with _Run(tmp_path):  # (entering resumes)
        pass
    assert not any(p.name.endswith(".removing") for p in tmp_path.iterdir())


def test_a_save_returns_with_what_keep_lets_go_removed(tmp_path: Path) -> None:
    """accelerate's save limit counts the directory's entries right after a save."""
    with _Run(tmp_path) as ckpt:
        for _ in range(3):
            saved = ckpt.save()
            assert saved is not None
            names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-"))
            assert names == [saved.name]  # nothing set aside is left behind
