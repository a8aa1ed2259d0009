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
