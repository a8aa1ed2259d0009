"""``resume()`` says in one line where the run continues (the checkpoint, its step, the
epoch and batch) and which half-written saves it removed; ``file=None`` silences it,
``log=`` sends it to a logger, as cudakit's other reporters do."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import torch

import cudakit


def _saved(root: Path, steps: int) -> Path:
    model = torch.nn.Linear(2, 1)
    step = cudakit.autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    fn = step(lambda x: model(x).square().mean())
    with cudakit.Checkpointer(root, step=step, preemption=False, file=None) as ckpt:
        for _ in range(steps):
            fn(torch.ones(1, 2))
        path = ckpt.save()
    assert path is not None
    return path


def _resumed(root: Path, **kw: object) -> cudakit.Checkpointer:
    model = torch.nn.Linear(2, 1)
    step = cudakit.autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    ckpt = cudakit.Checkpointer(root, step=step, preemption=False, **kw)  # type: ignore[arg-type]
    ckpt.resume()
    ckpt.close()
    return ckpt


def test_resume_writes_one_line_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _saved(tmp_path, 3)
    assert capsys.readouterr().err == ""  # (file=None)
    _resumed(tmp_path)
    err = capsys.readouterr().err
    assert err == f"cudakit.Checkpointer: resumed from {path} at step 3 (epoch 0, batch 0)\n"


def test_the_line_names_the_half_written_saves_it_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ckpt-0000000009.partial").mkdir()
    _resumed(tmp_path)
    err = capsys.readouterr().err
    assert err == (
        f"cudakit.Checkpointer: no complete checkpoint in {tmp_path}, starting fresh; "
        "removed the half-written ckpt-0000000009.partial\n"
    )


def test_a_fresh_start_says_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _resumed(tmp_path)
    assert capsys.readouterr().err == ""


def test_file_none_silences_and_log_or_a_stream_takes_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    _saved(tmp_path, 2)
    _resumed(tmp_path, file=None)
    stream = io.StringIO()
    _resumed(tmp_path, file=stream)
    with caplog.at_level(logging.INFO, logger="my.run"):
        _resumed(tmp_path, log=logging.getLogger("my.run"))
    assert capsys.readouterr().err == ""
    assert stream.getvalue().startswith("cudakit.Checkpointer: resumed from ")
    assert [r.getMessage()[:34] for r in caplog.records if r.name == "my.run"] == [
        "cudakit.Checkpointer: resumed from"
    ]


def test_file_and_log_of_the_wrong_kind_are_refused_before_anything(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    root = tmp_path / "new"
    with pytest.raises(TypeError, match=r"Checkpointer\(file=\.\.\.\) expects a text stream"):
        cudakit.Checkpointer(root, model=model, file=io.BytesIO())
    with pytest.raises(TypeError, match=r"Checkpointer\(log=\.\.\.\) expects a logging.Logger"):
        cudakit.Checkpointer(root, model=model, log=3)
    assert not root.exists()
