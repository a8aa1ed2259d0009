"""warmup() refuses a device it cannot use and changes nothing."""

from __future__ import annotations

import pytest
import torch

from cudakit.exceptions import DeviceError
from cudakit.warmup import warmup


def test_a_refused_warmup_device_changes_nothing() -> None:
    model = torch.nn.Linear(2, 2)
    weight = model.weight.detach().clone()
    rng = torch.get_rng_state()
    with pytest.raises(DeviceError):
        warmup(model, torch.ones(1, 2), device="gpu", loss_fn=lambda m, x: m(x).sum())
    assert torch.equal(model.weight, weight)
    assert model.weight.grad is None
    assert torch.equal(torch.get_rng_state(), rng)
