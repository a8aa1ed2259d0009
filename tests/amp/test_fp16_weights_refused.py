"""A model in float16 (``model.half()``) with ``dtype=torch.float16`` is refused when the
step is built, with the fp32 master-weights hint, instead of failing after the forward
and backward with torch's "Attempting to unscale FP16 gradients"."""

from __future__ import annotations

import pytest
import torch

from cudakit.amp import autocast_step


def test_fp16_weights_with_loss_scaling_are_refused_up_front() -> None:
    m = torch.nn.Linear(4, 1).half()
    with pytest.raises(
        ValueError,
        match=r"autocast_step\(dtype=torch\.float16\): 2 of the optimizer's parameters are "
        r"float16 \(model\.half\(\)\?\).*float32 master weights.*drop model\.half\(\)",
    ):
        autocast_step(torch.optim.SGD(m.parameters(), lr=0.1), dtype=torch.float16)


def test_fp16_weights_without_loss_scaling_are_left_alone() -> None:
    m = torch.nn.Linear(4, 1).half()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    step = autocast_step(
        opt, dtype=torch.float16, scaler=torch.amp.GradScaler("cpu", enabled=False)
    )
    assert step.scaler is not None
    assert not step.scaler.is_enabled()


def test_fp32_weights_with_fp16_autocast_are_fine() -> None:
    m = torch.nn.Linear(4, 1)
    step = autocast_step(torch.optim.SGD(m.parameters(), lr=0.1), dtype=torch.float16)
    assert step.scaler is not None
