"""device_info() and `cudakit demo` at the door: bad arguments answered before anything runs."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from cudakit.demo import main as demo_main
from cudakit.info import device_info

# --------------------------------------------------------------------------- device_info


@pytest.mark.parametrize("value", ["no", 1, None])
def test_device_info_init_cuda_must_be_a_bool(value: Any) -> None:
    with pytest.raises(
        TypeError,
        match=r"device_info\(init_cuda=\.\.\.\) expects True or False, got "
        + re.escape(type(value).__name__)
        + r".*Pass init_cuda=True or init_cuda=False",
    ):
        device_info(init_cuda=value)


def test_device_info_refusal_starts_nothing() -> None:
    initialized = torch.cuda.is_initialized()
    with pytest.raises(TypeError):
        device_info(init_cuda="yes")
    assert torch.cuda.is_initialized() == initialized


# --------------------------------------------------------------------------- cudakit demo


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        demo_main(list(argv))
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--seed", "100000000000000000000"],
            r"argument --seed: expected a non-negative integer seed, at most 4611686018427387904; "
            r"got 100000000000000000000\. Use a smaller number\.",
        ),
        (["--seed", "-1"], r"--seed: expected a non-negative integer seed, got -1"),
        (["--seed", "x"], r"--seed: expected a non-negative integer seed, got 'x'"),
        (["--epochs", "100000000000"], r"--epochs: expected a positive integer, at most 10000"),
        (["--train-size", "10" + "0" * 20], r"--train-size: .* at most 1000000; got 10+\."),
        (["--nprocs", "100000"], r"--nprocs: expected a positive integer, at most 256"),
    ],
)
def test_demo_out_of_range_numbers_are_clean_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    err = _error(capsys, *argv)
    assert re.search(message, err), err
    assert "Overflow" not in err
