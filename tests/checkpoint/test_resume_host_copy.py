"""What a load copies to host memory to put the run back should it fail.

A resume at the start of a run meets optimizers that have not stepped: DCP fills
their state only to load into it, and a failed load empties it again, so that
state is not copied (for AdamW two thirds of the state). The model's tensors are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudakit
import cudakit.checkpoint.reader as reader
from cudakit.amp import autocast_step


def _run(tmp: Path) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    @autocast_step(opt, model=model, dtype=torch.float32)
    def step(x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), torch.zeros(len(x), 2))

    return model, opt, step


def _copied_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = reader._to_host

    def counting(tree: Any) -> Any:
        out = real(tree)
        if isinstance(out, torch.Tensor):
            sizes.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(reader, "_to_host", counting)
    return sizes


def test_a_resume_into_fresh_optimizers_copies_only_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, opt, step = _run(tmp_path)
    for _ in range(2):
        step(torch.randn(4, 8))
    with cudakit.Checkpointer(tmp_path, step=step) as ckpt:
        ckpt.save()
    want = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    model2, opt2, step2 = _run(tmp_path)
    sizes = _copied_bytes(monkeypatch)
    with cudakit.Checkpointer(tmp_path, step=step2) as ckpt2:
        ckpt2.resume()
    model_bytes = sum(p.numel() * p.element_size() for p in model2.parameters())
    assert sum(sizes) == model_bytes
    got = opt2.state_dict()["state"][0]
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_failed_load_into_fresh_optimizers_still_leaves_them_empty(tmp_path: Path) -> None:
    _, _, step = _run(tmp_path)
    step(torch.randn(4, 8))
    with cudakit.Checkpointer(tmp_path, step=step) as ckpt:
        path = ckpt.save()
    assert path is not None
    data = sorted(path.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 :] = bytes(len(raw) - len(raw) // 2)  # same size, other bytes
    data.write_bytes(bytes(raw))
    model2, opt2, step2 = _run(tmp_path)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with (
        cudakit.Checkpointer(tmp_path, step=step2) as ckpt2,
        pytest.raises(cudakit.CheckpointError),
    ):
        ckpt2.load(path)
    assert not opt2.state
    assert all(torch.equal(before[k], v) for k, v in model2.state_dict().items())
