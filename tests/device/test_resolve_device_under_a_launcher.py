"""``resolve_device()`` under torchrun or SLURM, before CUDA starts: the process's own GPU.

Before CUDA is initialised torch's current device is 0 in every process, so a script
that resolved ``"auto"`` (or ``"cuda"``) before ``parallelize()`` put every rank on
GPU 0. The launcher already says which GPU is this process's: ``LOCAL_RANK`` (or
SLURM's ``SLURM_LOCALID``). Once CUDA runs, the current device is the answer, as before.
CUDA is faked: these run on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from cudakit.device import resolve_device


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ids without "cuda": the conftest skips tests whose keywords say cuda on a CPU machine.
@pytest.mark.parametrize(
    "spec", [None, "auto", "cuda", torch.device("cuda")], ids=["none", "auto", "str", "device"]
)
def test_torchrun_local_rank_picks_the_process_gpu(
    four_gpus: pytest.MonkeyPatch, spec: object
) -> None:
    four_gpus.setenv("LOCAL_RANK", "2")
    assert resolve_device(spec) == torch.device("cuda", 2)  # type: ignore[arg-type]


def test_an_explicit_index_is_honoured_under_a_launcher(four_gpus: pytest.MonkeyPatch) -> None:
    four_gpus.setenv("LOCAL_RANK", "2")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device(3) == torch.device("cuda", 3)


def test_slurm_local_id_picks_the_process_gpu(four_gpus: pytest.MonkeyPatch) -> None:
    four_gpus.setenv("SLURM_JOB_ID", "77")
    four_gpus.setenv("SLURM_PROCID", "3")
    four_gpus.setenv("SLURM_NTASKS", "4")
    four_gpus.setenv("SLURM_LOCALID", "3")
    four_gpus.setenv("SLURM_NODELIST", "node1")
    assert resolve_device() == torch.device("cuda", 3)


@pytest.mark.parametrize("local", ["5", "-1", "x", ""])
def test_a_local_rank_this_machine_cannot_serve_means_gpu_0(
    four_gpus: pytest.MonkeyPatch, local: str
) -> None:
    # One GPU per process through CUDA_VISIBLE_DEVICES: LOCAL_RANK 5 of a node whose
    # process sees its own single GPU (here: 4 visible, so index 5 is not one of them).
    four_gpus.setenv("LOCAL_RANK", local)
    assert resolve_device() == torch.device("cuda", 0)


def test_without_a_launcher_it_is_gpu_0(four_gpus: pytest.MonkeyPatch) -> None:
    assert resolve_device() == torch.device("cuda", 0)


def test_once_cuda_runs_the_current_device_wins(four_gpus: pytest.MonkeyPatch) -> None:
    four_gpus.setenv("LOCAL_RANK", "2")
    four_gpus.setattr(torch.cuda, "is_initialized", lambda: True)
    four_gpus.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device() == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
