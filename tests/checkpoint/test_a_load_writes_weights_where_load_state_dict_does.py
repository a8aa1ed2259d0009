"""A load writes a plain model's weights into their own memory, as ``load_state_dict``
does, and only at the very end, after every check and everything else that can fail:
a load that fails before leaves them untouched; a data file that cannot be read then
is named, says the models are partly loaded, and every other tensor is still read."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import cudakit
from cudakit.checkpoint import _unarchive as unarchive
from cudakit.exceptions import CheckpointError


class Counter:
    """An extra whose load can be made to fail."""

    def __init__(self) -> None:
        self.n = 0
        self.refuse = False

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.refuse:
            raise ValueError("refused")
        self.n = state["n"]


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], dict[Any, torch.Tensor]]:
    model, opt = _trained(0)
    ck = cudakit.Checkpointer(
        tmp_path / "c", model=model, optimizer=opt, extra={"c": Counter()}, preemption=False
    )
    ck.save()
    ck.close()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {
        (i, k): v.clone()
        for i, s in enumerate(opt.state.values())
        for k, v in s.items()
        if torch.is_tensor(v)
    }
    return tmp_path / "c", state, moments


def test_the_weights_are_loaded_into_their_own_memory(tmp_path: Path) -> None:
    """A view of a weight the user holds sees the loaded values, as after
    ``load_state_dict``; the optimizer's state is the checkpoint's, bit for bit."""
    root, state, moments = _saved(tmp_path)
    model, opt = _trained(1)
    views = {k: v.detach() for k, v in model.state_dict().items()}
    memory = {k: v.data_ptr() for k, v in views.items()}
    versions = {k: v._version for k, v in views.items()}
    ck = cudakit.Checkpointer(
        root, model=model, optimizer=opt, extra={"c": Counter()}, preemption=False
    )
    ck.resume()
    ck.close()
    for key, value in model.state_dict().items():
        assert value.data_ptr() == memory[key], key
        assert torch.equal(value, state[key]), key
        assert torch.equal(views[key], state[key]), key
        assert views[key]._version > versions[key], key  # counted as copy_ counts
    got = {
        (i, k): v
        for i, s in enumerate(opt.state.values())
        for k, v in s.items()
        if torch.is_tensor(v)
    }
    assert got.keys() == moments.keys()
    for entry, value in got.items():
        assert torch.equal(value, moments[entry]), entry


def test_a_load_that_fails_before_the_end_leaves_the_weights_untouched(tmp_path: Path) -> None:
    root, _, _ = _saved(tmp_path)
    model, opt = _trained(1)
    before = {k: (v.clone(), v.data_ptr()) for k, v in model.state_dict().items()}
    refusing = Counter()
    refusing.refuse = True
    ck = cudakit.Checkpointer(
        root, model=model, optimizer=opt, extra={"c": refusing}, preemption=False
    )
    with pytest.raises(CheckpointError, match="Nothing was changed"):
        ck.load(next(root.glob("ckpt-*")))
    ck.close()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key][0]), key
        assert value.data_ptr() == before[key][1], key


def test_a_data_file_that_cannot_be_read_at_the_end_says_partly_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first in-place read fails; every other one is still made, and the error
    names the checkpoint and says what was loaded."""
    root, state, _ = _saved(tmp_path)
    model, opt = _trained(1)
    real = unarchive._fill
    failed: list[int] = []

    def fill(stream: Any, buffer: memoryview) -> bool:
        if not failed and isinstance(stream, io.FileIO):
            failed.append(1)
            raise OSError(5, "Input/output error")
        return real(stream, buffer)

    monkeypatch.setattr(unarchive, "_fill", fill)
    ck = cudakit.Checkpointer(
        root, model=model, optimizer=opt, extra={"c": Counter()}, preemption=False
    )
    with pytest.raises(CheckpointError) as caught:
        ck.load(next(root.glob("ckpt-*")))
    ck.close()
    message = str(caught.value)
    assert "Checkpointer.load()" in message
    assert str(root) in message
    assert "partly" in message
    assert "Input/output error" in message
    assert failed
    same = [torch.equal(v, state[k]) for k, v in model.state_dict().items()]
    assert same.count(False) == 1  # only the tensor whose read failed


def test_an_interrupted_read_at_the_end_reads_every_tensor_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, state, _ = _saved(tmp_path)
    model, opt = _trained(1)
    real = unarchive._fill
    interrupted: list[int] = []

    def fill(stream: Any, buffer: memoryview) -> bool:
        done = real(stream, buffer)
        if not interrupted and isinstance(stream, io.FileIO):
            interrupted.append(1)
            raise KeyboardInterrupt
        return done

    monkeypatch.setattr(unarchive, "_fill", fill)
    ck = cudakit.Checkpointer(
        root, model=model, optimizer=opt, extra={"c": Counter()}, preemption=False
    )
    with pytest.raises(KeyboardInterrupt):
        ck.load(next(root.glob("ckpt-*")))
    ck.close()
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
