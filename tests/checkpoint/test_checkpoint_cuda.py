"""Checkpoints on a GPU: CUDA tensors and the CUDA RNG (run with `pytest -m cuda`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cudakit

pytestmark = pytest.mark.cuda


def test_a_cuda_run_resumes_its_cuda_rng_and_loads_on_the_cpu(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 4).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.ones(2, 8, device="cuda")).sum().backward()
    opt.step()
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False)
    torch.cuda.manual_seed(7)
    ckpt.save()
    expected = torch.rand(4, device="cuda")
    ckpt.close()

    torch.cuda.manual_seed(99)
    again_model = torch.nn.Linear(8, 4).cuda()
    again = cudakit.Checkpointer(
        tmp_path, model=again_model, optimizer=torch.optim.AdamW(again_model.parameters()),
        preemption=False,
    )  # fmt: skip
    again.resume()
    again.close()
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    assert torch.equal(again_model.weight, model.weight)

    cpu_model = torch.nn.Linear(8, 4)
    cpu = cudakit.Checkpointer(
        tmp_path, model=cpu_model, optimizer=torch.optim.AdamW(cpu_model.parameters()),
        preemption=False,
    )  # fmt: skip
    cpu.resume()
    cpu.close()
    assert torch.equal(cpu_model.weight, model.weight.cpu())


def test_a_background_save_of_a_cuda_model_stages_a_host_copy(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 4).cuda()
    saved = model.weight.detach().cpu().clone()
    ckpt = cudakit.Checkpointer(tmp_path, model=model, async_save=True, preemption=False)
    ckpt.save()
    with torch.no_grad():
        model.weight.add_(1.0)
    ckpt.close()
    target = torch.nn.Linear(8, 4)
    check = cudakit.Checkpointer(tmp_path, model=target, preemption=False)
    check.resume()
    check.close()
    assert torch.equal(target.weight, saved)


def test_a_small_background_save_of_a_cuda_model_writes_its_host_copy_beside_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread of a single-process background save only writes: the files of a
    model on the GPU are made on the loop from its host copy, not by DCP's own writer."""
    import os
    import threading

    from cudakit.checkpoint import _storage as storage

    model = torch.nn.Linear(8, 4).cuda()
    written: list[str] = []
    real_writev, real_write_file = os.writev, storage._write_file
    own: list[str] = []

    def writev(fd: int, buffers: object) -> int:
        written.append(threading.current_thread().name)
        return real_writev(fd, buffers)  # type: ignore[arg-type]

    def write_file(*args: object) -> object:
        own.append(threading.current_thread().name)
        return real_write_file(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "writev", writev)
    monkeypatch.setattr(storage, "_write_file", write_file)
    ckpt = cudakit.Checkpointer(tmp_path, model=model, async_save=True, preemption=False)
    ckpt.save()
    ckpt.close()
    loop = threading.main_thread().name
    assert own == [loop]
    assert written
    assert loop not in written
