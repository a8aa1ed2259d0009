"""speed_report on a GPU: CUDA events read lazily, the real device's peak (skips on CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from cudakit.amp import autocast_step
from cudakit.speed import count_flops, lookup_peak, speed_report

pytestmark = pytest.mark.cuda


class HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in ("item", "__bool__", "tolist"):
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_metered_cuda_steps_read_nothing_and_time_the_gpu_work() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 10)
    )
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(256, 512, device="cuda")
    y = torch.randint(0, 10, (256,), device="cuda")
    step = autocast_step(opt, model=model, accumulate=2)

    @step
    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    flops = count_flops(train, x, y)
    metered = speed_report(samples=len, tokens=lambda b: (b[:, 0] > -100).sum(), flops=flops,
                           every=None, file=None)(train)  # fmt: skip
    for _ in range(4):  # warm up
        metered(x, y)
    with HostReads() as reads:
        for _ in range(20):
            metered(x, y)
    assert reads.calls == []
    meter = metered.speed_report
    total = meter.total
    assert (total.steps, total.calls, total.samples, total.tokens) == (12, 24, 24 * 256, 24 * 256)
    assert total.seconds > 0
    assert total.flops == pytest.approx(24 * flops.total)
    peak = lookup_peak(torch.cuda.get_device_name(), step.dtype)
    assert meter.peak.tflops == peak.tflops
    if peak.tflops is not None:
        assert 0 < meter.mfu < 1  # type: ignore[operator]
    else:
        assert meter.mfu is None
        assert meter.mfu_reason == peak.reason
