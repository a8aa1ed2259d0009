"""A save tells the disk to start writing a data file's bytes as they are written (every
``_PIECE`` bytes, Linux's ``sync_file_range``), so that the fsync at the end waits for
the last ones only; where the system has no such call or refuses it, the fsync writes
everything, and the file is the same bytes either way."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import cudakit
from cudakit.checkpoint import _storage as storage


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    return model, opt


def _data_file(root: Path, background: bool = False) -> bytes:
    model, opt = _model()
    ckpt = cudakit.Checkpointer(
        root, model=model, optimizer=opt, async_save=background, preemption=False
    )
    ckpt.save()
    ckpt.wait()
    path = ckpt.latest
    ckpt.close()
    assert path is not None
    return (path / "__0_0.distcp").read_bytes()


class Recorder:
    """A ``sync_file_range`` that records its ranges and answers ``answer``."""

    def __init__(self, answer: int = 0) -> None:
        self.answer = answer
        self.ranges: list[tuple[int, int, int]] = []

    def __call__(self, fd: int, offset: int, nbytes: int, flags: int) -> int:
        self.ranges.append((offset, nbytes, flags))
        return self.answer


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 256 bytes, and tensors of 4 KiB or more written straight to the file."""
    monkeypatch.setattr(storage, "_PIECE", 256)
    monkeypatch.setattr(storage, "DIRECT", 4096)


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.usefixtures("small_pieces")
def test_the_disk_starts_writing_each_piece_in_order_and_the_bytes_are_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    monkeypatch.setattr(storage, "_sync_file_range", lambda: None)
    expected = _data_file(tmp_path / "plain", background)
    recorder = Recorder()
    monkeypatch.setattr(storage, "_sync_file_range", lambda: recorder)
    written = _data_file(tmp_path / "started", background)
    assert written == expected
    # (a small background save writes its gathered pieces in one call)
    assert len(recorder.ranges) >= (1 if background else 3)
    at = 0
    for offset, nbytes, flags in recorder.ranges:
        assert offset == at, "the ranges follow one another from the file's start"
        assert nbytes >= 256
        assert flags == 2  # SYNC_FILE_RANGE_WRITE alone: start writing, never wait
        at = offset + nbytes
    assert at <= len(written)
    assert len(written) - at < 256 + 64 * 64 * 4 + 1024  # at most a piece and an archive


@pytest.mark.usefixtures("small_pieces")
def test_a_system_that_refuses_is_not_asked_again_and_the_save_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage, "_sync_file_range", lambda: None)
    expected = _data_file(tmp_path / "plain")
    refusing = Recorder(answer=-1)
    monkeypatch.setattr(storage, "_sync_file_range", lambda: refusing)
    assert _data_file(tmp_path / "refused") == expected
    assert len(refusing.ranges) == 1  # once for the file, then never again
    model, opt = _model()
    ckpt = cudakit.Checkpointer(tmp_path / "refused", model=model, optimizer=opt)
    for p in model.parameters():
        p.data.zero_()
    ckpt.resume()
    ckpt.close()
    assert all(p.abs().sum() > 0 for p in model.parameters())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_linux_has_the_call() -> None:
    storage._sync_file_range.cache_clear()
    assert storage._sync_file_range() is not None
