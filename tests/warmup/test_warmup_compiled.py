"""warmup() of a torch.compile'd model: under the step's autocast, or a warning."""

from __future__ import annotations

import warnings

import pytest
import torch

from cudakit import CompiledWarmupWarning
from cudakit.amp import autocast_step
from cudakit.warmup import warmup


def _compiled() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    return net, torch.compile(net)


def test_compiled_model_without_amp_warns() -> None:
    _net, model = _compiled()
    batch = (torch.randn(4, 8), torch.randn(4, 1))
    with pytest.warns(CompiledWarmupWarning, match="GLOBAL_STATE changed: autocast.*amp=step"):
        warmup(model, batch, loss_fn=torch.nn.MSELoss(), steps=1)


def test_compiled_model_warmed_under_the_steps_autocast_does_not_recompile() -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    net, model = _compiled()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    step = autocast_step(opt, dtype=torch.bfloat16)
    batch = (torch.randn(4, 8), torch.randn(4, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompiledWarmupWarning)
        warmup(model, batch, loss_fn=torch.nn.MSELoss(), amp=step, steps=2)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1

    @step
    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(x).float(), y)

    for _ in range(3):
        train(*batch)
    assert counters["stats"]["unique_graphs"] == graphs  # training reused warm-up's graph
    assert step.steps == 3
