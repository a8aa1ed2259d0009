"""On a GPU: the estimate against the CUDA allocator's peak, recompute on a real
step, and a meta-built model allocated without holding more than it must.

Skipped without a GPU; ``scripts/gpu-check`` runs them (``pytest -m cuda``), and each
assertion's message carries the measured figure.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import cudakit.parallel as cp
from cudakit.memory import estimate_memory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_memory_estimate import Net  # the model the CPU's estimate tests measure

pytestmark = pytest.mark.cuda

TOLERANCE = 0.10


def _warm_cuda() -> None:
    """cuBLAS's workspace is allocated at the first matmul and kept: not the model's."""
    a = torch.randn(64, 64, device="cuda")
    (a @ a).sum().item()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (a @ a).sum().item()
    torch.cuda.synchronize()


def _cuda_peak(
    depth: int, width: int, shape: tuple[int, ...], policy: str | None, precision: str
) -> int:
    """Bytes the CUDA allocator held at its peak over two AdamW steps, above the start."""
    _warm_cuda()
    torch.manual_seed(0)
    model = cp.parallelize(Net(depth, width), "none", device="cuda", recompute=policy)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(shape, device="cuda")
    torch.cuda.synchronize()
    # The model and the batch count as the estimate counts them: from nothing.
    held = torch.cuda.memory_allocated()
    base = held - sum(p.numel() * p.element_size() for p in model.parameters())
    base -= x.numel() * x.element_size()
    torch.cuda.reset_peak_memory_stats()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(x).sum()
        loss.backward()
        del loss
        opt.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("policy", [None, "full", "selective"])
def test_the_estimate_is_within_ten_percent_of_the_cuda_peak(
    policy: str | None, precision: str
) -> None:
    depth, width, shape = 4, 256, (8, 128, 256)
    measured = _cuda_peak(depth, width, shape, policy, precision)
    with torch.device("meta"):
        meta = Net(depth, width)
    estimate = estimate_memory(
        meta, torch.empty(shape, device="meta"), recompute=policy, precision=precision
    )
    ratio = estimate.peak / measured
    assert abs(ratio - 1) <= TOLERANCE, (
        f"estimate / torch.cuda.max_memory_allocated = {ratio:.3f} "
        f"({estimate.peak / 2**20:.1f} MiB / {measured / 2**20:.1f} MiB), "
        f"policy={policy}, {precision}"
    )


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_on_a_cuda_step_gives_the_same_gradients(policy: str) -> None:
    torch.manual_seed(0)
    plain = Net(3, 128).cuda()
    again = cp.recompute(Net(3, 128).cuda(), policy)
    again.load_state_dict(plain.state_dict())
    x = torch.randn(4, 64, 128, device="cuda")
    plain(x).sum().backward()
    again(x).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), again.parameters(), strict=True):
        assert a.grad is not None
        assert b.grad is not None
        # The recompute replays the same kernels on the same inputs.
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)


def test_a_meta_model_is_allocated_without_a_second_copy() -> None:
    with torch.device("meta"):
        model = Net(8, 512)  # 8 blocks of 2.1M parameters: 33 MiB in fp32
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    _warm_cuda()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    cp.parallelize(model, "none", device="cuda", init_seed=3)
    peak = torch.cuda.max_memory_allocated() - start
    bound = total + largest
    assert peak <= bound * 1.1, (
        f"setup peak {peak / 2**20:.1f} MiB against the model {total / 2**20:.1f} MiB "
        f"+ the largest tensor {largest / 2**20:.1f} MiB = {peak / bound:.3f}x"
    )
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert all(math.isfinite(p.abs().sum().item()) for p in model.parameters())
