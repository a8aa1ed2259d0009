"""device_info() and the `cudakit info` command, on CPU and with a faked CUDA stack."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from cudakit.cli import main
from cudakit.info import DeviceInfo, device_info


def test_device_info_on_this_machine() -> None:
    info = device_info()
    assert isinstance(info, DeviceInfo)
    assert info.torch_version == torch.__version__
    assert info.cuda_available == torch.cuda.is_available()
    assert json.loads(info.to_json())["torch_version"] == torch.__version__


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA report")
def test_no_cuda_says_so_plainly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "CUDA available  False" in out
    assert "No CUDA GPU is available here; training will run on cpu." in out
    assert not torch.cuda.is_initialized()


def test_json_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in (
        "torch_version",
        "cuda_version",
        "cudnn_version",
        "cuda_available",
        "device_count",
        "current_device",
        "devices",
        "training_device",
    ):
        assert key in data


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "info" in capsys.readouterr().out


def test_python_dash_m_and_version() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cudakit", "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    assert proc.stdout.startswith("cudakit ")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    state = {"initialized": False}
    props = [
        SimpleNamespace(
            name="NVIDIA H100", major=9, minor=0, total_memory=80 * 2**30, multi_processor_count=132
        ),
        SimpleNamespace(
            name="Tesla T4", major=7, minor=5, total_memory=16 * 2**30, multi_processor_count=40
        ),
    ]

    def get_props(i: int) -> SimpleNamespace:
        state["initialized"] = True
        return props[i]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", get_props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (2**30 * (i + 1), 0))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 1024 * (i + 1))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i: 4096)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    return state


def test_does_not_start_cuda_by_default(fake_cuda: dict[str, bool]) -> None:
    info = device_info()
    assert not fake_cuda["initialized"]
    assert info.devices == ()
    assert info.note is not None
    assert "init_cuda=True" in info.note


def test_full_report_with_fake_gpus(fake_cuda: dict[str, bool]) -> None:
    info = device_info(init_cuda=True)
    assert [d.name for d in info.devices] == ["NVIDIA H100", "Tesla T4"]
    assert [d.bf16_native for d in info.devices] == [True, False]
    assert info.devices[1].free_memory == 2 * 2**30
    assert info.cudnn_version == 91000
    assert info.training_device == "cuda:0"
    text = str(info)
    assert "cuda:0  NVIDIA H100" in text
    assert "compute capability 7.5, 40 SMs, bf16 native: no" in text
    assert "free 2.00 GiB" in text
    assert "allocated 2.00 KiB, reserved 1.00 MiB, peak allocated 4.00 KiB" in text


@pytest.mark.cuda
def test_real_gpu_report() -> None:
    info = device_info(init_cuda=True)
    assert info.device_count == torch.cuda.device_count() == len(info.devices)
    for d in info.devices:
        assert d.total_memory > 0
        assert d.free_memory is not None
        assert 0 < d.free_memory <= d.total_memory
