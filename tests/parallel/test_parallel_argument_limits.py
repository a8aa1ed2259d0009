"""cudakit.parallel's arguments at their limits: timeouts, wrapped models, unknown device
types, distributed_loader's option values."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
from torch import nn

import cudakit.parallel as cp
from cudakit.exceptions import DeviceError


@pytest.mark.parametrize("timeout", [1e300, 1e12, datetime.timedelta.max])
def test_timeouts_past_a_year_are_refused(timeout: Any) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"parallelize\(timeout=\.\.\.\) expects at most 365 days"):
        cp.parallelize(model, device="cpu", timeout=timeout)


def test_an_already_wrapped_model_still_gets_its_arguments_checked() -> None:
    wrapped = nn.DataParallel(nn.Linear(2, 2))
    with pytest.raises(DeviceError, match="did you mean 'cuda'"):
        cp.parallelize(wrapped, device="gpu")
    assert cp.parallelize(wrapped, device="cpu") is wrapped


@pytest.mark.parametrize("device_type", ["gpu", "CUDA", ""])
def test_choose_strategy_refuses_unknown_device_types(device_type: str) -> None:
    with pytest.raises(ValueError, match=r"device_type=\.\.\.\) expects a torch device type"):
        cp.choose_strategy("auto", env={}, device_count=2, device_type=device_type)


def test_distributed_loader_checks_option_values() -> None:
    ds = torch.utils.data.TensorDataset(torch.arange(8.0))
    with pytest.raises(ValueError, match=r"distributed_loader\(\): drop_last=True needs"):
        cp.distributed_loader(ds, None, drop_last=True)
    with pytest.raises(ValueError, match=r"distributed_loader\(num_workers=\.\.\.\)"):
        cp.distributed_loader(ds, 2, num_workers=-1)
    with pytest.raises(TypeError, match=r"distributed_loader\(generator=\.\.\.\) expects"):
        cp.distributed_loader(ds, 2, generator="x")
