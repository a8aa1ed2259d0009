"""The options ``parallelize`` hands its wrapper (DDP, DataParallel, ``fully_shard``) are
checked at the door, names and values: a bad one is a clear error before the model is
moved or sharded and before a process group starts, never an ``IndexError`` or an
``AttributeError`` from inside the wrapper."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launcher_env import clean_launcher_env, free_port, torchrun_env  # noqa: F401 (autouse fixture)
from torch import nn

import cudakit.parallel as cp
from cudakit.parallel.strategy import ParallelFacts, choose_plan

FOUR_GPUS = ParallelFacts(
    env=None,
    group_world_size=None,
    cuda_available=True,
    device_count=4,
    current_cuda_index=0,
    requested_device=None,
    best_device=torch.device("cuda", 0),
)
CPU = dataclasses.replace(
    FOUR_GPUS, cuda_available=False, device_count=0, best_device=torch.device("cpu")
)
TORCHRUN_CPU = dataclasses.replace(CPU, env=cp.DistributedEnv(0, 2, 0, 2, "127.0.0.1", 29500))


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in torchrun_env(1, 0, free_port()).items():
        monkeypatch.setenv(k, v)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_mesh_that_is_not_a_device_mesh_is_refused_before_sharding(one_rank: None) -> None:
    torch.manual_seed(0)
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    params = [id(p) for p in net.parameters()]
    with pytest.raises(
        TypeError,
        match=r"parallelize\(mesh=\.\.\.\) expects a torch\.distributed\.device_mesh\.DeviceMesh, "
        r"or None, got str 'cpu'\. Build one with init_device_mesh",
    ):
        cp.parallelize(net, "fsdp", mesh="cpu", timeout=30)
    assert not dist.is_initialized()  # no group started
    assert [id(p) for p in net.parameters()] == params
    assert all(type(p) is nn.Parameter for p in net.parameters())  # not sharded
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


@pytest.mark.parametrize(
    ("request_", "facts", "error", "match"),
    [
        ("dp", FOUR_GPUS, ValueError, r"expects a non-empty list of devices, got list \[\]\. "),
        ("auto", FOUR_GPUS, ValueError, r"expects a non-empty list of devices, got list \[\]\. "),
        ("ddp", TORCHRUN_CPU, ValueError, r"expects a non-empty list of devices, got list \[\]"),
    ],
)
def test_empty_device_ids_are_a_clear_error(
    request_: str, facts: ParallelFacts, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=r"choose_plan\(device_ids=\.\.\.\) " + match) as info:
        choose_plan(request_, facts, options={"device_ids": []})
    assert "[] names no device. Pass device_ids=None (the default" in str(info.value)


def test_empty_device_ids_through_parallelize() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"parallelize\(device_ids=\.\.\.\) expects a non-empty"):
        cp.parallelize(model, device="cpu", device_ids=[])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"device_ids": [0, 7]}, r"device_ids=\.\.\.\) expects CUDA indices below 4 .*got int 7"),
        ({"device_ids": [1, 1]}, r"device_ids=\.\.\.\) expects each device once"),
        ({"device_ids": ["cpu"]}, r"device_ids=\.\.\.\) expects CUDA devices with an index"),
        ({"device_ids": 0}, r"device_ids=\.\.\.\) expects a list of devices"),
        ({"device_ids": [1.5]}, r"device_ids=\.\.\.\) expects a list of devices"),
        ({"output_device": -1}, r"output_device=\.\.\.\) expects a CUDA index >= 0"),
        ({"dim": "0"}, r"dim=\.\.\.\) expects an int"),
    ],
)
def test_dataparallel_option_values(options: dict[str, Any], match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=r"choose_plan\(" + match):
        choose_plan("dp", FOUR_GPUS, options=options)


def test_dataparallel_device_ids_name_its_devices() -> None:
    plan = choose_plan("dp", FOUR_GPUS, options={"device_ids": [torch.device("cuda", 2), "cuda:3"]})
    assert plan.device_ids == (2, 3)
    assert plan.device == torch.device("cuda", 2)


@pytest.mark.parametrize("request_", ["auto", "ddp"])
@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"bucket_cap_mb": -1}, ValueError, r"bucket_cap_mb=\.\.\.\) expects a positive finite"),
        ({"bucket_cap_mb": 0}, ValueError, r"bucket_cap_mb=\.\.\.\) expects a positive finite"),
        ({"bucket_cap_mb": float("nan")}, ValueError, r"bucket_cap_mb=\.\.\.\) expects a positive"),
        (
            {"bucket_cap_mb": "25"},
            TypeError,
            r"bucket_cap_mb=\.\.\.\) expects a positive finite number of MiB",
        ),
        ({"bucket_cap_mb_list": [25, -1]}, ValueError, r"bucket_cap_mb_list=\.\.\.\) expects a"),
        ({"find_unused_parameters": "yes"}, TypeError, r"find_unused_parameters=\.\.\.\) expects"),
        ({"broadcast_buffers": 1}, TypeError, r"broadcast_buffers=\.\.\.\) expects True or False"),
        ({"static_graph": None}, TypeError, r"static_graph=\.\.\.\) expects True or False"),
        ({"device_ids": [0, 1]}, ValueError, r"device_ids=\.\.\.\) expects None or a list of one"),
        ({"process_group": "world"}, TypeError, r"process_group=\.\.\.\) expects a torch\.distr"),
        ({"device_mesh": "cpu"}, TypeError, r"device_mesh=\.\.\.\) expects a torch\.distributed"),
        ({"bucket_cap": 25}, TypeError, r"\) got keyword argument\(s\) 'bucket_cap' that Distrib"),
    ],
)
def test_ddp_option_values(
    request_: str, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    # Under "auto" the options are DDP's, checked even where this run picks no DDP.
    with pytest.raises(error, match=r"choose_plan\(" + match):
        choose_plan(request_, TORCHRUN_CPU, options=options)
    with pytest.raises(error, match=r"choose_plan\(" + match):
        choose_plan("auto", CPU, options=options)


def test_good_ddp_options_pass_through() -> None:
    options = {"bucket_cap_mb": 0.5, "broadcast_buffers": None, "find_unused_parameters": True}
    plan = choose_plan("ddp", TORCHRUN_CPU, options=options)
    assert plan.wrapper_kwargs == options
    assert choose_plan("auto", CPU, options=options).ignored == options


def test_options_of_the_wrong_kind() -> None:
    with pytest.raises(TypeError, match=r"choose_plan\(options=\.\.\.\) expects a mapping"):
        choose_plan("auto", CPU, options=[("bucket_cap_mb", 25)])  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"options=...\) expects strings as wrapper option names, got int 1"
    ):
        choose_plan("auto", CPU, options={1: 2})


def test_a_bucket_cap_refused_through_parallelize_changes_nothing(one_rank: None) -> None:
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match=r"parallelize\(bucket_cap_mb=\.\.\.\) expects a positive"):
        cp.parallelize(net, "ddp", bucket_cap_mb=-1, timeout=30)
    assert not dist.is_initialized()
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_the_options_mapping_is_not_changed() -> None:
    options = {"find_unused_parameters": True}
    choose_plan("ddp", dataclasses.replace(TORCHRUN_CPU), options=options)
    assert options == {"find_unused_parameters": True}
