"""cudakit.parallel.unwrap against accelerate's extract_model_from_parallel tests.

Ported from Hugging Face accelerate tests/test_utils.py (test_extract_model,
test_dynamo_extract_model_remove_torch_compile / keep_torch_compile).
"""

from __future__ import annotations

import torch
from port_accelerate_helpers import RegressionModel

import cudakit.parallel as cp


def test_extract_model() -> None:
    model = RegressionModel()
    assert cp.unwrap(torch.nn.DataParallel(model)) is model


def test_extract_model_remove_torch_compile() -> None:
    model = RegressionModel()
    assert cp.unwrap(torch.compile(torch.nn.DataParallel(model))) is model
    assert cp.unwrap(torch.nn.DataParallel(torch.compile(model))) is model
