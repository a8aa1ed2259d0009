"""A load reads an optimizer's state tensors into the optimizer's own memory, at the
very end, after every check, as it reads a plain model's weights: the optimizer keeps
its tensors (no new memory, no page faults for two thirds of an AdamW run's state); a
load that fails before leaves them untouched; an optimizer that loads in a way of its
own gets new tensors, as ``load_state_dict`` gives it."""

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

    def __init__(self, refuse: bool = False) -> None:
        self.n = 0
        self.refuse = refuse

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.refuse:
            raise ValueError("refused")
        self.n = state["n"]


class CopyingAdamW(torch.optim.AdamW):
    """An optimizer whose ``load_state_dict`` keeps copies of what it is given."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        copied = {
            "state": {
                k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                for k, s in state_dict["state"].items()
            },
            "param_groups": state_dict["param_groups"],
        }
        super().load_state_dict(copied)


def _trained(seed: int, kind: type = torch.optim.AdamW, **options: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    opt = kind(model.parameters(), lr=1e-2, **options)
    for _ in range(seed + 1):
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _moments(opt: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    return {
        (i, k): v
        for i, s in enumerate(opt.state.values())
        for k, v in s.items()
        if torch.is_tensor(v) and k != "step"
    }


def _checkpointer(
    root: Path, model: nn.Module, opt: torch.optim.Optimizer, refuse: bool = False
) -> cudakit.Checkpointer:
    return cudakit.Checkpointer(
        root, model=model, optimizer=opt, extra={"c": Counter(refuse)}, preemption=False
    )


def _saved(tmp_path: Path, kind: type = torch.optim.AdamW, **options: Any) -> tuple[Path, Any]:
    model, opt = _trained(0, kind, **options)
    ck = _checkpointer(tmp_path / "c", model, opt)
    ck.save()
    ck.close()
    return tmp_path / "c", {e: v.clone() for e, v in _moments(opt).items()}


@pytest.mark.parametrize("options", [{}, {"foreach": False}, {"fused": True}])
def test_the_optimizer_keeps_its_tensors_holding_the_checkpoint(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    root, saved = _saved(tmp_path, **options)
    model, opt = _trained(1, **options)
    held = {e: (v, v.data_ptr()) for e, v in _moments(opt).items()}
    ck = _checkpointer(root, model, opt)
    ck.resume()
    ck.close()
    got = _moments(opt)
    assert got.keys() == saved.keys()
    for entry, value in got.items():
        assert value is held[entry][0], entry
        assert value.data_ptr() == held[entry][1], entry
        assert torch.equal(value, saved[entry]), entry


def test_a_load_that_fails_before_the_end_leaves_the_optimizer_state_untouched(
    tmp_path: Path,
) -> None:
    root, _ = _saved(tmp_path)
    model, opt = _trained(1)
    before = {e: (v.clone(), v) for e, v in _moments(opt).items()}
    steps = [s["step"].clone() for s in opt.state.values()]
    ck = _checkpointer(root, model, opt, refuse=True)
    with pytest.raises(CheckpointError, match="Nothing was changed"):
        ck.load(next(root.glob("ckpt-*")))
    ck.close()
    after = _moments(opt)
    assert after.keys() == before.keys()
    for entry, value in after.items():
        assert value is before[entry][1], entry
        assert torch.equal(value, before[entry][0]), entry
    assert all(torch.equal(s["step"], n) for s, n in zip(opt.state.values(), steps, strict=True))


def test_an_optimizer_that_loads_its_own_way_gets_the_checkpoint_all_the_same(
    tmp_path: Path,
) -> None:
    root, saved = _saved(tmp_path, CopyingAdamW)
    model, opt = _trained(1, CopyingAdamW)
    ck = _checkpointer(root, model, opt)
    ck.resume()
    ck.close()
    got = _moments(opt)
    assert got.keys() == saved.keys()
    for entry, value in got.items():
        assert torch.equal(value, saved[entry]), entry


def test_a_state_file_that_cannot_be_read_at_the_end_says_optimizers_are_partly_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every in-place read but the failing one is made; the error says what is loaded."""
    root, saved = _saved(tmp_path)
    model, opt = _trained(1)
    real = unarchive._fill
    calls: list[int] = []

    def fill(stream: Any, buffer: memoryview) -> bool:
        if isinstance(stream, io.FileIO):
            calls.append(1)
            if len(calls) == 7:  # past the 6 weights: an optimizer's tensor
                raise OSError(5, "Input/output error")
        return real(stream, buffer)

    monkeypatch.setattr(unarchive, "_fill", fill)
    ck = _checkpointer(root, model, opt)
    with pytest.raises(CheckpointError) as caught:
        ck.load(next(root.glob("ckpt-*")))
    ck.close()
    message = str(caught.value)
    assert "partly loaded" in message
    assert "the models and optimizers are partly loaded" in message
    assert "Input/output error" in message
    assert len(calls) > 7  # the others were read all the same
    same = [torch.equal(v, saved[e]) for e, v in _moments(opt).items()]
    assert same.count(False) == 1


def test_an_optimizer_that_kept_copies_after_all_fails_the_load_changing_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were torch's load to copy what it is given, the copies would hold the old values
    (the new ones are read at the end): the load refuses instead, as any failure."""
    root, _ = _saved(tmp_path)
    model, opt = _trained(1)
    before = {e: (v.clone(), v) for e, v in _moments(opt).items()}
    real = torch.optim.Optimizer._process_value_according_to_param_policy

    def copying(*args: Any, **kwargs: Any) -> torch.Tensor:
        return real(*args, **kwargs).clone()

    monkeypatch.setattr(
        torch.optim.Optimizer,
        "_process_value_according_to_param_policy",
        staticmethod(copying),
    )
    ck = _checkpointer(root, model, opt)
    with pytest.raises(CheckpointError, match="did not keep the state tensors"):
        ck.load(next(root.glob("ckpt-*")))
    ck.close()
    for entry, value in _moments(opt).items():
        assert value is before[entry][1], entry
        assert torch.equal(value, before[entry][0]), entry
