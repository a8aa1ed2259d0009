"""resolve_device: every accepted spec and every error."""

from __future__ import annotations

import pytest
import torch

from cudakit import DeviceError, resolve_device


def test_auto_and_none_pick_best_available() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device().type == expected
    assert resolve_device("auto").type == expected


@pytest.mark.parametrize("spec", ["cpu", "meta", torch.device("cpu"), torch.device("meta")])
def test_explicit_devices_pass_through(spec: str | torch.device) -> None:
    assert resolve_device(spec) == torch.device(spec)


@pytest.mark.parametrize(
    ("spec", "suggestion"),
    [
        ("gpu", "'cuda'"),
        ("GPU", "'cuda'"),
        ("cuda0", "'cuda:0'"),
        ("cdua", "'cuda'"),
        ("CPU", "'cpu'"),
    ],
)
def test_typos_suggest_the_right_spelling(spec: str, suggestion: str) -> None:
    with pytest.raises(DeviceError, match=f"unknown device '{spec}'; did you mean {suggestion}"):
        resolve_device(spec)


def test_negative_int_is_an_error() -> None:
    with pytest.raises(DeviceError, match="negative CUDA index"):
        resolve_device(-1)


@pytest.mark.parametrize("spec", [1.5, True, [0], object()])
def test_wrong_types(spec: object) -> None:
    with pytest.raises(TypeError, match="device must be a torch.device"):
        resolve_device(spec)  # type: ignore[arg-type]


def test_device_error_is_a_value_error() -> None:
    assert issubclass(DeviceError, ValueError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:7", 0, 3, torch.device("cuda", 1)])
def test_cuda_without_cuda_is_a_clear_error(spec: object) -> None:
    with pytest.raises(DeviceError, match='CUDA is not available.*device="auto"'):
        resolve_device(spec)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks the no-MPS error")
def test_mps_without_mps() -> None:
    with pytest.raises(DeviceError, match="MPS, which is not available"):
        resolve_device("mps")


def test_cuda_index_out_of_range_names_existing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with pytest.raises(DeviceError, match=r"has 2 visible CUDA device\(s\): cuda:0, cuda:1"):
        resolve_device("cuda:7")
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device(1) == torch.device("cuda", 1)
    assert resolve_device(None) == torch.device("cuda", 0)


@pytest.mark.cuda
def test_cuda_resolves_to_current_device() -> None:
    assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
    assert resolve_device(0) == torch.device("cuda", 0)
