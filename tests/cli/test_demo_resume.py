"""`cudakit demo --resume DIR`: a checkpoint every epoch, and a second start continues."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cudakit.demo import main


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert (
        main(["--train-size", "128", "--batch-size", "16", "--no-progress", "--json", *args]) == 0
    )
    return json.loads(capsys.readouterr().out)


def test_a_second_start_continues_from_the_newest_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _run(capsys, "--epochs", "1", "--resume", str(tmp_path))
    assert first["resumed_from"] is None
    assert [e["epoch"] for e in first["epochs"]] == [1]
    second = _run(capsys, "--epochs", "2", "--resume", str(tmp_path))
    assert second["resumed_from"].endswith("ckpt-0000000004")  # 8 batches, 4 steps
    assert [e["epoch"] for e in second["epochs"]] == [2]
    done = main(["--train-size", "128", "--batch-size", "16", "--no-progress",
                 "--epochs", "2", "--resume", str(tmp_path)])  # fmt: skip
    assert done == 0
    assert "nothing left to train" in capsys.readouterr().out


def test_an_unwritable_resume_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as info:
        main(["--train-size", "128", "--epochs", "1", "--resume", str(blocker / "ck")])
    assert info.value.code == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_a_run_resumed_with_more_epochs_equals_one_that_never_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--epochs 2`` then ``--epochs 3 --resume``: the learning-rate schedule does not
    depend on --epochs, so epoch 3 is the plain 3-epoch run's, bit for bit."""
    _run(capsys, "--epochs", "2", "--resume", str(tmp_path / "a"))
    resumed = _run(capsys, "--epochs", "3", "--resume", str(tmp_path / "a"))
    plain = _run(capsys, "--epochs", "3")
    assert resumed["resumed_from"] is not None
    last, expected = resumed["epochs"][-1], plain["epochs"][-1]
    for key in ("train_loss", "val_loss", "val_accuracy"):
        assert last[key] == expected[key], key
