"""parallelize() answers every bad argument at the door, and a refused call changes nothing.

Its own arguments, the options it hands its wrapper (DDP, DataParallel, ``fully_shard``),
a model that is already wrapped, a wrapper that refuses its options after the group
started, and the arguments of the pure decision behind it (``choose_strategy``,
``choose_plan``, ``ParallelFacts``, ``read_env``)."""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launcher_env import clean_launcher_env, free_port, torchrun_env  # noqa: F401 (autouse fixture)
from small_models import Net
from small_models import snapshot as _snapshot
from small_models import unchanged as _unchanged
from torch import nn

import cudakit.parallel as cp
from cudakit.exceptions import DeviceError, DistributedSetupError
from cudakit.parallel.strategy import ParallelFacts, check_backend, choose_plan


def _state_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


CPU = ParallelFacts(
    env=None,
    group_world_size=None,
    cuda_available=False,
    device_count=0,
    current_cuda_index=0,
    requested_device=None,
    best_device=torch.device("cpu"),
)


TORCHRUN_CPU = dataclasses.replace(CPU, env=cp.DistributedEnv(1, 2, 1, 2, "127.0.0.1", 29500))


TORCHRUN_GPUS = dataclasses.replace(
    TORCHRUN_CPU, cuda_available=True, device_count=2, best_device=torch.device("cuda", 0)
)


FOUR_GPUS = ParallelFacts(
    env=None,
    group_world_size=None,
    cuda_available=True,
    device_count=4,
    current_cuda_index=0,
    requested_device=None,
    best_device=torch.device("cuda", 0),
)


TORCHRUN_CPU_0 = dataclasses.replace(CPU, env=cp.DistributedEnv(0, 2, 0, 2, "127.0.0.1", 29500))


# ------------------------------------------------------------------------- parallelize


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"timeout": "x"},
            TypeError,
            r"parallelize\(timeout=\.\.\.\) expects seconds \(an int or float\) or a "
            r"datetime.timedelta, got str 'x'\. Pass e\.g\. timeout=600",
        ),
        ({"timeout": -1}, ValueError, r"parallelize\(timeout=\.\.\.\) expects a finite positive"),
        ({"timeout": float("nan")}, ValueError, r"finite positive duration, got float nan"),
        ({"timeout": True}, TypeError, r"timeout=\.\.\.\) expects seconds .* got bool True"),
        (
            {"backend": 3},
            TypeError,
            r"parallelize\(backend=\.\.\.\) expects a string such as 'nccl' or 'gloo', or "
            r"None, got int 3\. Pass backend=None",
        ),
        (
            {"backend": "glooo"},
            ValueError,
            r"parallelize\(backend=\.\.\.\) expects one of 'gloo', 'nccl'.*got str 'glooo'",
        ),
        ({"strategy": 2}, TypeError, r"parallelize\(strategy=\.\.\.\) expects one of 'auto'"),
        ({"strategy": "DP"}, ValueError, r"parallelize\(strategy=\.\.\.\) .* got str 'DP'"),
        (
            {"device": "gpu"},
            DeviceError,
            r"parallelize\(device=\.\.\.\): unknown device 'gpu'; did you mean 'cuda'",
        ),
        ({"device": 1.5}, TypeError, r"parallelize\(device=\.\.\.\): device must be a"),
        (
            {"device": "cuda:7"} if not torch.cuda.is_available() else {"device": "cuda:99"},
            DeviceError,
            r"parallelize\(device=\.\.\.\): .*CUDA",
        ),
        (
            {"device": "cpu", "bogus": 1},
            TypeError,
            r"parallelize\(strategy='none'\) takes no wrapper options, got \['bogus'\]",
        ),
    ],
)
def test_parallelize_bad_arguments(
    kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    net = nn.Linear(2, 2)
    before = _snapshot(net)
    strategy = kwargs.pop("strategy", "auto")
    if "bogus" in kwargs:
        strategy = "none"
    with pytest.raises(exc, match=match):
        cp.parallelize(net, strategy, **kwargs)
    assert _unchanged(net, before)
    assert not dist.is_initialized()


def test_parallelize_errors() -> None:
    with pytest.raises(DeviceError, match=r"needs CUDA devices.*strategy='auto' to fall back"):
        cp.parallelize(nn.Linear(2, 2), "dp", device="cpu")
    with pytest.raises(DistributedSetupError, match=r"torchrun --nproc-per-node N script.py"):
        cp.parallelize(nn.Linear(2, 2), "ddp", device="cpu")
    with pytest.raises(DistributedSetupError, match=r"strategy='fsdp' needs one process"):
        cp.parallelize(nn.Linear(2, 2), "fsdp", device="cpu")
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"got SGD (?s:.*)\. Pass the model, not the optimizer"):
        cp.parallelize(opt)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"parallelize\(model=\.\.\.\) expects an nn.Module, got list \[.*\]\. For example",
    ):
        cp.parallelize([nn.Linear(2, 2)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"got str 'DDP'\. Did you mean strategy='ddp'"):
        cp.parallelize(nn.Linear(2, 2), "DDP")
    with pytest.raises(TypeError, match=r"strategy='none'\) takes no wrapper options"):
        cp.parallelize(nn.Linear(2, 2), "none", device="cpu", gradient_as_bucket_view=True)
    with pytest.raises(DeviceError, match=r"asks for CUDA"):
        cp.parallelize(nn.Linear(2, 2), device="cuda:7")


def _as_one_launched_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment torchrun gives the one process of a one-process launch."""
    for k, v in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")


def test_parallelize_refusal_under_a_launcher_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _as_one_launched_process(monkeypatch)
    net = nn.Linear(2, 2)
    before = _snapshot(net)
    with pytest.raises(TypeError, match=r"'bogus' that DistributedDataParallel does not accept"):
        cp.parallelize(net, "ddp", device="cpu", bogus=1)
    with pytest.raises(ValueError, match=r"backend=\.\.\.\) expects one of"):
        cp.parallelize(net, "ddp", device="cpu", backend="smoke-signals")
    assert _unchanged(net, before)
    assert not dist.is_initialized()  # no group was started for a call that was refused


def test_parallelize_accepts_good_timeouts_and_backends() -> None:
    net = nn.Linear(2, 2)
    for timeout in (None, 5, 2.5, datetime.timedelta(seconds=3)):
        assert cp.parallelize(net, device="cpu", timeout=timeout) is net
    for backend in (None, "gloo", "GLOO", "cpu:gloo,cuda:nccl"):
        assert cp.parallelize(net, device="cpu", backend=backend) is net


@pytest.mark.parametrize("timeout", [1e300, 1e12, datetime.timedelta.max])
def test_timeouts_past_a_year_are_refused(timeout: Any) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"parallelize\(timeout=\.\.\.\) expects at most 365 days"):
        cp.parallelize(model, device="cpu", timeout=timeout)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pinned memory needs no GPU here")
def test_a_pinned_cpu_offload_without_an_accelerator_is_refused_at_the_door(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    _as_one_launched_process(monkeypatch)
    net = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2)]))
    before = _snapshot(net)
    with pytest.raises(
        ValueError,
        match=r"parallelize\(offload_policy=\.\.\.\) expects CPUOffloadPolicy\(pin_memory=False\) "
        r"on a machine without a GPU, got CPUOffloadPolicy CPUOffloadPolicy\(pin_memory=True\)\. "
        r"Pinned memory is for copies to a GPU: pass CPUOffloadPolicy\(pin_memory=False\)",
    ):
        cp.parallelize(net, "fsdp", device="cpu", offload_policy=CPUOffloadPolicy())
    assert _unchanged(net, before)
    assert not dist.is_initialized()


# --------------------------------------------------------------------- wrapper options


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
        ("ddp", TORCHRUN_CPU_0, ValueError, r"expects a non-empty list of devices, got list \[\]"),
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
        choose_plan(request_, TORCHRUN_CPU_0, options=options)
    with pytest.raises(error, match=r"choose_plan\(" + match):
        choose_plan("auto", CPU, options=options)


def test_good_ddp_options_pass_through() -> None:
    options = {"bucket_cap_mb": 0.5, "broadcast_buffers": None, "find_unused_parameters": True}
    plan = choose_plan("ddp", TORCHRUN_CPU_0, options=options)
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
    choose_plan("ddp", dataclasses.replace(TORCHRUN_CPU_0), options=options)
    assert options == {"find_unused_parameters": True}


def test_auto_on_one_device_refuses_a_misspelt_ddp_option() -> None:
    with pytest.raises(TypeError, match=r"'find_unused_paramters' that DistributedDataParallel"):
        cp.parallelize(nn.Linear(2, 2), device="cpu", find_unused_paramters=True)
    net = nn.Linear(2, 2)
    assert cp.parallelize(net, device="cpu", find_unused_parameters=True) is net  # ignored


# -------------------------------------------------------------- a wrapper that refuses


@pytest.mark.parametrize(
    ("strategy", "options", "error", "match"),
    [
        (
            "ddp",
            {"device_ids": [5]},
            ValueError,
            r"parallelize\(\): DistributedDataParallel refused .*device_ids \[5\].*"
            r"The model is as it was\. The process group this call started was destroyed",
        ),
        (
            "fsdp",
            {"reshard_after_forward": "x"},
            TypeError,
            r"parallelize\(reshard_after_forward=\.\.\.\) expects True, False or an int",
        ),
        (
            "fsdp",
            {"mp_policy": torch.bfloat16},
            TypeError,
            r"parallelize\(mp_policy=\.\.\.\) expects a torch.distributed.fsdp.MixedPrecision",
        ),
    ],
    ids=["ddp-device_ids", "fsdp-reshard", "fsdp-mp_policy"],
)
def test_a_wrapper_that_refuses_its_options_leaves_no_group_and_the_model_as_it_was(
    one_rank: None, strategy: str, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    torch.manual_seed(0)
    net = Net()
    before = _state_copy(net)
    params = [id(p) for p in net.parameters()]
    with pytest.raises(error, match=match):
        cp.parallelize(net, strategy, timeout=30, **options)
    assert not dist.is_initialized()  # the group this call started is gone again
    assert [id(p) for p in net.parameters()] == params
    assert all(type(p) is nn.Parameter for p in net.parameters())  # not sharded
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    # The same model can then be parallelized with good options.
    wrapped = cp.parallelize(net, strategy, timeout=30)
    assert cp.unwrap(wrapped) is net


def test_a_refused_call_keeps_a_group_it_did_not_start(one_rank: None) -> None:
    with cp.process_group(timeout=30):
        with pytest.raises(ValueError, match=r"DistributedDataParallel refused"):
            cp.parallelize(Net(), "ddp", device_ids=[5])
        assert dist.is_initialized()  # the user's group: left alone


def test_a_refused_ddp_on_meta_is_refused_before_anything(one_rank: None) -> None:
    net = Net()
    with pytest.raises(ValueError, match=r"parallelize\(device='meta'\) with DDP"):
        cp.parallelize(net, "ddp", device="meta")
    assert not dist.is_initialized()
    assert all(p.device.type == "cpu" for p in net.parameters())


def test_a_failed_move_back_still_destroys_the_group(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cudakit.parallel import wrap as cp_wrap

    class Refusing(nn.parallel.DistributedDataParallel):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ValueError("DDP says no")

    monkeypatch.setattr(nn.parallel, "DistributedDataParallel", Refusing)
    # Where the model "was": a device it cannot go back to on this machine.
    monkeypatch.setattr(cp_wrap, "_devices_of", lambda model: {torch.device("cuda", 7)})
    with pytest.raises(ValueError, match=r"DDP says no.*Moving it back to cuda:7 failed too"):
        cp.parallelize(Net(), "ddp", timeout=30)
    assert not dist.is_initialized()


# ------------------------------------------------------------- a model already wrapped


def test_an_already_wrapped_model_still_gets_its_arguments_checked() -> None:
    wrapped = nn.DataParallel(nn.Linear(2, 2))
    with pytest.raises(DeviceError, match="did you mean 'cuda'"):
        cp.parallelize(wrapped, device="gpu")
    assert cp.parallelize(wrapped, device="cpu") is wrapped


def test_already_wrapped_model_still_checks_option_names() -> None:
    wrapped = nn.DataParallel(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"takes no wrapper options, got \[.bogus.\]"):
        cp.parallelize(wrapped, "none", bogus=1)
    assert cp.parallelize(wrapped) is wrapped  # "auto": returned as it is


def test_already_wrapped_model_refuses_another_wrapper(one_rank: None) -> None:
    wrapped = nn.DataParallel(nn.Linear(2, 2))
    with pytest.raises(
        ValueError, match=r"strategy='fsdp'\): the model is already wrapped in DataParallel"
    ):
        cp.parallelize(wrapped, "fsdp")
    with pytest.raises(ValueError, match=r"cudakit.parallel.unwrap\(model\)"):
        cp.parallelize(wrapped, "ddp")
    with pytest.raises(TypeError, match=r"'bogus' that DistributedDataParallel \(strategy='auto'"):
        cp.parallelize(wrapped, bogus=1)  # "auto": checked against the wrapper it has
    assert not dist.is_initialized()


def test_already_wrapped_ddp_model_with_its_own_strategy_is_returned(one_rank: None) -> None:
    ddp = cp.parallelize(Net(), "ddp", timeout=30)
    assert cp.parallelize(ddp, "ddp") is ddp
    assert cp.parallelize(ddp) is ddp
    with pytest.raises(TypeError, match=r"'bucket_cap'"):
        cp.parallelize(ddp, "ddp", bucket_cap=25)  # a typo of bucket_cap_mb
    with pytest.raises(ValueError, match=r"already wrapped in DistributedDataParallel"):
        cp.parallelize(ddp, "fsdp")


def test_auto_checks_a_wrapped_models_options_as_ddp_options() -> None:
    wrapped = nn.DataParallel(nn.Linear(2, 2))
    assert cp.parallelize(wrapped, find_unused_parameters=True) is wrapped


# -------------------------------------------------------- choose_strategy and read_env


def test_choose_strategy_env_must_be_a_mapping_of_strings() -> None:
    with pytest.raises(
        TypeError,
        match=r"choose_strategy\(env=\.\.\.\) expects a mapping of environment variable names "
        r"to strings, got NoneType None\. Pass env=os.environ",
    ):
        cp.choose_strategy(env=None, device_count=0, device_type="cpu")  # type: ignore[arg-type]
    env = {"WORLD_SIZE": 2}
    with pytest.raises(
        TypeError, match=r"WORLD_SIZE is not a string, got int 2\. Pass WORLD_SIZE='2'"
    ):
        cp.choose_strategy(env=env, device_count=0, device_type="cpu")  # type: ignore[arg-type]
    assert env == {"WORLD_SIZE": 2}
    assert cp.choose_strategy(env=os.environ, device_count=0, device_type="cpu") == "none"


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"device_count": "2"},
            TypeError,
            r"choose_strategy\(device_count=\.\.\.\) expects an int",
        ),
        (
            {"device_count": -1},
            ValueError,
            r"choose_strategy\(device_count=\.\.\.\) expects an int >= 0",
        ),
        (
            {"device_type": None},
            TypeError,
            r"choose_strategy\(device_type=\.\.\.\) expects a string",
        ),
        (
            {"group_world_size": 1.0},
            TypeError,
            r"choose_strategy\(group_world_size=\.\.\.\) expects",
        ),
        (
            {"group_world_size": 0},
            ValueError,
            r"choose_strategy\(group_world_size=\.\.\.\) expects",
        ),
    ],
)
def test_choose_strategy_names_itself(
    kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    args: dict[str, Any] = {"env": {}, "device_count": 0, "device_type": "cpu", **kwargs}
    with pytest.raises(exc, match=match):
        cp.choose_strategy(**args)


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        ("DDP", ValueError, r"got str 'DDP'\. Did you mean strategy='ddp'\?"),
        ("DataParallel", ValueError, r"Did you mean strategy='dp'\?"),
        ("fsdp2", ValueError, r"Did you mean strategy='fsdp'\?"),
        ("ddpp", ValueError, r"expects one of 'auto', .*Did you mean strategy='ddp'\?"),
        (2, TypeError, r"strategy=\.\.\.\) expects one of 'auto', .* got int 2\. Pass strategy"),
    ],
)
def test_choose_strategy_bad_request(bad: Any, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        cp.choose_strategy(bad, env={}, device_count=0, device_type="cpu")


def test_choose_strategy_argument_errors() -> None:
    with pytest.raises(ValueError, match=r"device_count=\.\.\.\) expects an int >= 0, got int -1"):
        cp.choose_strategy(env={}, device_count=-1, device_type="cpu")
    with pytest.raises(TypeError, match=r"device_count=\.\.\.\) expects an int >= 0, got bool"):
        cp.choose_strategy(env={}, device_count=True, device_type="cpu")
    with pytest.raises(TypeError, match=r"device_type=...\) expects a string .* Pass torch.device"):
        cp.choose_strategy(env={}, device_count=0, device_type=torch.device("cpu"))  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"group_world_size=\.\.\.\) expects an int >= 1, got int 0"
    ):
        cp.choose_strategy(env={}, device_count=0, device_type="cpu", group_world_size=0)
    with pytest.raises(TypeError, match=r"group_world_size=\.\.\.\) expects an int >= 1, got str"):
        cp.choose_strategy(env={}, device_count=0, device_type="cpu", group_world_size="2")  # type: ignore[arg-type]


@pytest.mark.parametrize("device_type", ["gpu", "CUDA", ""])
def test_choose_strategy_refuses_unknown_device_types(device_type: str) -> None:
    with pytest.raises(ValueError, match=r"device_type=\.\.\.\) expects a torch device type"):
        cp.choose_strategy("auto", env={}, device_count=2, device_type=device_type)


def test_read_env_checks_its_argument() -> None:
    with pytest.raises(TypeError, match=r"read_env\(env=\.\.\.\) expects a mapping"):
        cp.read_env([("WORLD_SIZE", "2")])  # type: ignore[arg-type]


# ------------------------------------------------------- choose_plan and ParallelFacts


@pytest.mark.parametrize(
    ("request_", "guess"),
    [("DDP", "ddp"), ("Auto", "auto"), ("fsdp2", "fsdp"), ("FSDP", "fsdp"), ("dataparallel", "dp")],
)
def test_an_unknown_request_is_refused_with_a_suggestion(request_: str, guess: str) -> None:
    with pytest.raises(
        ValueError,
        match=r"choose_plan\(strategy=\.\.\.\) expects one of 'auto', 'none', 'dp', 'ddp', "
        rf"'fsdp', got str {request_!r}\. Did you mean strategy={guess!r}\?",
    ):
        choose_plan(request_, TORCHRUN_CPU)


@pytest.mark.parametrize("request_", [3, None, b"ddp", ["ddp"]])
def test_a_request_of_the_wrong_kind_is_a_type_error(request_: Any) -> None:
    with pytest.raises(
        TypeError,
        match=r"choose_plan\(strategy=\.\.\.\) expects one of 'auto', 'none', 'dp', 'ddp', "
        r"'fsdp', got .*Pass strategy='auto'",
    ):
        choose_plan(request_, CPU)


@pytest.mark.parametrize("facts", [CPU, TORCHRUN_CPU])
@pytest.mark.parametrize(
    ("backend", "reason"),
    [
        ("nccl", "NCCL runs collectives on CUDA tensors only"),
        ("NCCL", "NCCL runs collectives on CUDA tensors only"),
        ("cuda:nccl", "the map has no entry for 'cpu'"),
    ],
)
def test_nccl_on_a_cpu_plan_is_refused(facts: ParallelFacts, backend: str, reason: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"choose_plan\(backend=\.\.\.\): {backend!r} gives the device cpu no "
        rf"backend it can run collectives with: {reason}\. Pass backend='gloo' \(or None, "
        r"which picks gloo on the CPU\)",
    ):
        choose_plan("auto", facts, backend=backend)


def test_backends_that_serve_the_device_are_planned() -> None:
    assert choose_plan("ddp", TORCHRUN_CPU, backend="gloo").backend == "gloo"
    mapped = choose_plan("ddp", TORCHRUN_CPU, backend="cpu:gloo,cuda:nccl")
    assert mapped.backend == "cpu:gloo,cuda:nccl"
    assert choose_plan("ddp", TORCHRUN_GPUS, backend="nccl").backend == "nccl"
    assert choose_plan("ddp", TORCHRUN_GPUS).backend == "nccl"
    assert choose_plan("ddp", TORCHRUN_CPU).backend == "gloo"


@pytest.mark.parametrize(
    ("backend", "guess"),
    [("ncl", "nccl"), ("glo", "gloo"), ("cpu:gloo,cuda:ncl", "nccl"), ("NCCCL", "nccl")],
)
def test_an_unknown_backend_is_refused_with_the_list_and_a_suggestion(
    backend: str, guess: str
) -> None:
    with pytest.raises(
        ValueError,
        match=rf"choose_plan\(backend=\.\.\.\) expects one of 'gloo', 'nccl', .*'mpi' \(or a "
        rf"map such as 'cpu:gloo,cuda:nccl'\), got str {backend!r}\. Did you mean {guess!r}\? "
        r"Pass backend=None to pick nccl on CUDA and gloo on the CPU",
    ):
        choose_plan("ddp", TORCHRUN_GPUS, backend=backend)


@pytest.mark.parametrize("backend", ["foo", "my_backend", "cpu:gloo,cuda:custom"])
def test_a_name_torch_may_learn_later_is_planned_and_refused_at_setup(backend: str) -> None:
    # A plugin may register a backend (Backend.register_backend) before the group starts:
    # the plan takes a name that is no typo, parallelize (which starts the group) refuses it.
    assert choose_plan("ddp", TORCHRUN_GPUS, backend=backend).backend == backend
    with pytest.raises(ValueError, match=r"parallelize\(backend=\.\.\.\) expects one of"):
        check_backend("parallelize", backend)


@pytest.mark.parametrize("backend", ["gloo", "nccl", "mpi", "ucc", "xccl", "cpu:gloo,cuda:nccl"])
def test_every_backend_torch_names_is_planned(backend: str) -> None:
    assert choose_plan("ddp", TORCHRUN_GPUS, backend=backend).backend == backend


def test_a_backend_of_the_wrong_kind_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"choose_plan\(backend=\.\.\.\) expects a string"):
        choose_plan("auto", CPU, backend=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("facts", "shown"),
    [
        (None, "NoneType None"),
        ({"env": None, "cuda_available": False}, "dict {'env': None"),
        ("cpu", "str 'cpu'"),
    ],
)
def test_facts_of_the_wrong_kind_are_a_type_error(facts: Any, shown: str) -> None:
    with pytest.raises(TypeError) as info:
        choose_plan("auto", facts)
    text = str(info.value)
    assert text.startswith("choose_plan(facts=...) expects a ParallelFacts")
    assert shown in text
    assert "gather_facts(device" in text  # the fix: read them, or build them by hand
    assert "ParallelFacts(env=" in text


@pytest.mark.parametrize(
    ("field", "value", "error", "expected"),
    [
        ("env", {"RANK": "0"}, TypeError, r"a cudakit\.parallel\.DistributedEnv or None"),
        ("group_world_size", 0, ValueError, r"an int >= 1 or None"),
        ("group_world_size", "2", TypeError, r"an int >= 1 or None"),
        ("cuda_available", 1, TypeError, r"True or False"),
        ("device_count", -1, ValueError, r"an int >= 0"),
        ("device_count", 2.0, TypeError, r"an int >= 0"),
        ("current_cuda_index", -1, ValueError, r"an int >= 0 or None"),
        ("requested_device", "cpu", TypeError, r"a torch\.device or None"),
        ("best_device", None, TypeError, r"a torch\.device"),
    ],
)
def test_parallel_facts_check_their_fields(
    field: str, value: Any, error: type[Exception], expected: str
) -> None:
    with pytest.raises(error, match=rf"ParallelFacts\({field}=\.\.\.\) expects {expected}, got "):
        dataclasses.replace(CPU, **{field: value})


def test_the_documented_facts_still_plan() -> None:
    plan = choose_plan("auto", CPU, options={"find_unused_parameters": True})
    assert (plan.strategy, plan.device, plan.ignored) == (
        "none",
        torch.device("cpu"),
        {"find_unused_parameters": True},
    )
