"""cudakit.parallel answers every bad argument at the door, and a refused call changes nothing.

Also: the pure plan behind ``parallelize`` over every combination of facts, the
``DataLoader`` that ``distributed_loader`` returns, and how ``LaunchError`` words
failures that are independent rather than consequences.
"""

from __future__ import annotations

import datetime
import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cudakit.parallel as cp
from cudakit._dist import (
    current_rank,
    current_world_size,
    launched_local_rank,
    launched_local_world_size,
    launched_rank,
    launched_world_size,
)
from cudakit.exceptions import DeviceError, DistributedSetupError
from cudakit.parallel import group as cp_group
from cudakit.parallel._failures import RankEnd, explain
from cudakit.parallel.strategy import (
    ParallelFacts,
    choose_plan,
    gather_facts,
    rank_device,
)

_LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (*_LAUNCHER_VARS, "MASTER_PORT", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    yield
    cp_group.teardown_owned_group()
    assert not dist.is_initialized()


def _snapshot(model: nn.Module) -> list[tuple[str, torch.device, torch.Tensor]]:
    return [(k, v.device, v.detach().clone()) for k, v in model.state_dict().items()]


def _unchanged(model: nn.Module, before: list[tuple[str, torch.device, torch.Tensor]]) -> bool:
    after = _snapshot(model)
    return len(after) == len(before) and all(
        k1 == k2 and d1 == d2 and torch.equal(t1, t2)
        for (k1, d1, t1), (k2, d2, t2) in zip(before, after, strict=True)
    )


# --------------------------------------------------------------------------- parallelize


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


def test_parallelize_allocates_and_initialises_a_meta_model() -> None:
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    same = cp.parallelize(net, device="meta")  # meta to meta: nothing to copy
    assert same is net
    assert all(p.is_meta for p in net.parameters())
    out = cp.parallelize(net, device="cpu")
    assert out is net
    assert not any(t.is_meta for t in [*net.parameters(), *net.buffers()])
    assert torch.equal(net[1].running_var, torch.ones(2))


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


# --------------------------------------------------------------------------- process_group


def test_process_group_checks_every_argument_at_the_call() -> None:
    with pytest.raises(TypeError, match=r"process_group\(backend=\.\.\.\) expects a string"):
        cp.process_group(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"process_group\(backend=\.\.\.\) expects one of"):
        cp.process_group("carrier-pigeon")
    with pytest.raises(DeviceError, match=r"process_group\(device=\.\.\.\): unknown device"):
        cp.process_group(device="gpu")
    with pytest.raises(TypeError, match=r"process_group\(device=\.\.\.\): device must be"):
        cp.process_group(device=[0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"process_group\(timeout=\.\.\.\) expects seconds"):
        cp.process_group(timeout=[1])  # type: ignore[arg-type]
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- choose_strategy


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


def test_read_env_checks_its_argument() -> None:
    with pytest.raises(TypeError, match=r"read_env\(env=\.\.\.\) expects a mapping"):
        cp.read_env([("WORLD_SIZE", "2")])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- small helpers


def test_rank_helpers_check_their_arguments() -> None:
    with pytest.raises(TypeError, match=r"is_main_process\(local=\.\.\.\) expects True or False"):
        cp.is_main_process(local="no")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"main_process_first\(local=\.\.\.\) expects True or False"
    ):
        cp.main_process_first(local="no")  # type: ignore[arg-type]


def test_state_dict_helpers_check_their_arguments() -> None:
    net = nn.Linear(2, 2)
    before = _snapshot(net)
    with pytest.raises(
        TypeError, match=r"state_dict\(model=\.\.\.\) expects an nn.Module, got dict"
    ):
        cp.state_dict({})  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"load_state_dict\(model=\.\.\.\) expects an nn.Module, got str"
    ):
        cp.load_state_dict("net", {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"load_state_dict\(strict=\.\.\.\) expects True or"):
        cp.load_state_dict(net, nn.Linear(2, 2).state_dict(), strict="yes")  # type: ignore[arg-type]
    assert _unchanged(net, before)


def test_launch_start_method_kind_and_value() -> None:
    with pytest.raises(TypeError, match=r"launch\(start_method=\.\.\.\) .*'spawn'.*got int 3"):
        cp.launch(print, nprocs=1, start_method=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"launch\(start_method=\.\.\.\) .* got str 'thread'"):
        cp.launch(print, nprocs=1, start_method="thread")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- distributed_loader


def _numbers() -> Iterator[int]:
    yield from range(3)


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        (
            (None,),
            {},
            TypeError,
            r"distributed_loader\(dataset=\.\.\.\) expects a map-style dataset \(with "
            r"__getitem__ and __len__\), got NoneType None\. Pass e\.g\.",
        ),
        (
            (_numbers(),),
            {},
            TypeError,
            r"distributed_loader\(dataset=\.\.\.\) expects a map-style dataset .* got generator "
            r".*materialise it with list\(\.\.\.\)",
        ),
        (
            (iter([1, 2]),),
            {},
            TypeError,
            r"got list_iterator",
        ),
        ((), {"seed": "a"}, TypeError, r"distributed_loader\(seed=\.\.\.\) expects an int"),
        ((), {"seed": 2**64}, ValueError, r"distributed_loader\(seed=\.\.\.\) expects an int"),
        ((), {"seed": 1.0}, TypeError, r"distributed_loader\(seed=\.\.\.\) expects an int"),
        ((), {"shuffle": "no"}, TypeError, r"distributed_loader\(shuffle=\.\.\.\) expects True"),
        ((), {"drop_last": 1}, TypeError, r"distributed_loader\(drop_last=\.\.\.\) expects True"),
        ((), {"batch_size": 0}, ValueError, r"distributed_loader\(batch_size=\.\.\.\) expects"),
        ((), {"batch_size": "8"}, TypeError, r"distributed_loader\(batch_size=\.\.\.\) expects"),
        (
            (),
            {"num_wrokers": 2},
            TypeError,
            r"distributed_loader\(\) got keyword argument\(s\) 'num_wrokers' that DataLoader "
            r"does not accept\. Valid: num_workers",
        ),
        ((), {"batch_sampler": None}, TypeError, r"so batch_sampler= cannot be passed"),
    ],
)
def test_distributed_loader_bad_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    data = TensorDataset(torch.arange(4))
    with pytest.raises(exc, match=match):
        cp.distributed_loader(*(args or (data,)), **kwargs)
    assert torch.equal(data.tensors[0], torch.arange(4))


def test_distributed_loader_is_a_dataloader() -> None:
    data = TensorDataset(torch.arange(6))
    loader = cp.distributed_loader(data, batch_size=2, shuffle=False, num_workers=0)
    assert isinstance(loader, DataLoader)
    assert isinstance(loader, cp.DistributedLoader)
    assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)
    assert (loader.batch_size, loader.num_workers, loader.drop_last) == (2, 0, False)
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    assert loader.epoch == 1
    with pytest.raises(TypeError, match=r"set_epoch\(epoch=\.\.\.\) expects an int >= 0, got str"):
        loader.set_epoch("1")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"set_epoch\(epoch=\.\.\.\) expects an int >= 0, got int -2"
    ):
        loader.set_epoch(-2)
    assert loader.epoch == 1
    assert len(cp.distributed_loader(data, batch_size=None)) == 6  # single samples


def test_distributed_loader_persistent_workers_reshuffle() -> None:
    data = TensorDataset(torch.arange(16))
    loader = cp.distributed_loader(
        data, batch_size=16, seed=1, num_workers=1, persistent_workers=True
    )
    first = next(iter(loader))[0].tolist()
    second = next(iter(loader))[0].tolist()
    assert sorted(first) == sorted(second) == list(range(16))
    assert first != second  # set_epoch reached the sampler the worker iterates


# --------------------------------------------------------------------------- _dist


def test_dist_reads_the_launcher_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (launched_rank(), launched_world_size(), launched_local_rank()) == (0, 1, 0)
    assert launched_local_world_size() == 1
    assert (current_rank(), current_world_size()) == (0, 1)
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert (launched_rank(env), launched_world_size(env), launched_local_rank(env)) == (3, 4, 1)
    assert launched_local_world_size(env) == 2
    assert launched_local_world_size({"SLURM_NTASKS_PER_NODE": "8"}) == 8
    bad = {"RANK": "x", "WORLD_SIZE": "0", "LOCAL_RANK": "", "LOCAL_WORLD_SIZE": "-1"}
    assert (launched_rank(bad), launched_world_size(bad), launched_local_rank(bad)) == (0, 1, 0)
    assert launched_local_world_size(bad) == 1
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert (current_rank(), current_world_size(), cp.rank(), cp.world_size()) == (2, 3, 2, 3)


# --------------------------------------------------------------------------- choose_plan

_ENVS: dict[str, cp.DistributedEnv | None] = {
    "none": None,
    "one": cp.DistributedEnv(0, 1, 0, 1, "127.0.0.1", 29500),
    "two": cp.DistributedEnv(1, 2, 1, 2, "127.0.0.1", 29500),
}
_REQUESTED: dict[str, torch.device | None] = {
    "own": None,
    "cpu": torch.device("cpu"),
    "cuda1": torch.device("cuda", 1),
}


def _facts(env: str, group: int | None, count: int, requested: str) -> ParallelFacts:
    return ParallelFacts(
        env=_ENVS[env],
        group_world_size=group,
        cuda_available=count > 0,
        device_count=count,
        current_cuda_index=0,
        requested_device=_REQUESTED[requested],
        best_device=torch.device("cuda", 0) if count else torch.device("cpu"),
    )


def test_plan_parallel_every_combination() -> None:
    combos = itertools.product(
        ("auto", "none", "dp", "ddp", "fsdp"),
        _ENVS,
        (None, 1, 2),
        (0, 1, 2, 4),
        _REQUESTED,
        ({}, {"find_unused_parameters": True}),
        (None, "gloo"),
    )
    seen = set()
    for request, env, group, count, requested, options, backend in combos:
        if requested == "cuda1" and count < 2:
            continue  # resolve_device refuses it before any plan is made
        facts = _facts(env, group, count, requested)
        try:
            plan = choose_plan(request, facts, backend=backend, options=options)
        except (DeviceError, DistributedSetupError, TypeError) as err:
            seen.add(type(err).__name__)
            continue
        world = group if group is not None else {"none": None, "one": 1, "two": 2}[env]
        device = rank_device(facts)
        seen.add(plan.strategy)
        assert plan.request == request
        if plan.strategy in ("ddp", "fsdp"):
            assert world is not None
            assert plan.create_group == (group is None)
            expected_backend = backend or ("nccl" if device.type == "cuda" else "gloo")
            assert plan.backend == (expected_backend if group is None else None)
            assert plan.device == device
            assert plan.ignored == {}
            if plan.strategy == "ddp" and device.type == "cuda":
                assert plan.wrapper_kwargs["device_ids"] == [device.index]
            assert all(plan.wrapper_kwargs[k] == v for k, v in options.items())
        elif plan.strategy == "dp":
            assert device.type == "cuda"
            assert plan.device_ids is not None
            assert plan.device_ids[0] == device.index
            assert sorted(plan.device_ids) == list(range(count))
            assert plan.ignored == (options if request == "auto" else {})
            assert not plan.create_group
            assert plan.backend is None
        else:
            assert plan.device == device
            assert plan.ignored == options
            assert plan.wrapper_kwargs == {}
            assert not plan.create_group
        # the same facts always give the same plan: nothing else is read
        assert choose_plan(request, facts, backend=backend, options=options) == plan
    assert {"none", "dp", "ddp", "fsdp", "DeviceError", "DistributedSetupError"} <= seen
    assert "TypeError" in seen  # options for an explicit strategy='none'


def test_rank_device_rules() -> None:
    assert rank_device(_facts("two", None, 2, "own")) == torch.device("cuda", 1)
    assert rank_device(_facts("two", None, 1, "own")) == torch.device("cuda", 0)  # one GPU each
    assert rank_device(_facts("none", 2, 4, "own")) == torch.device("cuda", 0)  # current device
    assert rank_device(_facts("two", None, 0, "own")) == torch.device("cpu")
    assert rank_device(_facts("two", None, 2, "cpu")) == torch.device("cpu")
    four = ParallelFacts(
        env=cp.DistributedEnv(3, 4, 3, 4, "h", 1),
        group_world_size=None,
        cuda_available=True,
        device_count=2,
        current_cuda_index=0,
        requested_device=None,
        best_device=torch.device("cuda", 0),
    )
    with pytest.raises(DistributedSetupError, match=r"LOCAL_RANK=3 but only 2 CUDA device"):
        rank_device(four)


def test_gather_facts_reads_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    facts = gather_facts("cpu", strict_env=False, func="parallelize")
    assert facts.env is None
    assert facts.group_world_size is None
    assert facts.requested_device == torch.device("cpu")
    assert gather_facts(None, strict_env=False, func="parallelize").requested_device is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert gather_facts(None, strict_env=False, func="parallelize").env is None
    with pytest.raises(DistributedSetupError, match=r"incomplete launcher environment"):
        gather_facts(None, strict_env=True, func="parallelize")


# --------------------------------------------------------------------------- LaunchError wording


def _raised(rank: int, when: float, text: bytes) -> RankEnd:
    """A rank that reported ``text`` at ``when`` and exited with code 1."""
    return RankEnd(rank, 10 + rank, 1, False, text.decode(), when, when + 0.1)


def test_launch_error_words_independent_failures() -> None:
    cause = b"Traceback ...\n  raise ValueError\nValueError: bad batch\n"
    other = b"Traceback ...\nKeyError: 'label'\n"
    echo = b"Traceback ...\nRuntimeError: [../gloo/pair.cc:534] Connection closed by peer\n"
    same = explain([_raised(0, 2.0, cause), _raised(1, 1.0, cause)])
    assert same is not None
    assert str(same).startswith(
        "rank 1 of 2 (pid 11) failed: ValueError: bad batch\n"
        "(rank 0 failed too, independently, with the same error)\n\n"
    )
    assert "probably as a consequence" not in str(same)
    different = explain([_raised(0, 1.0, cause), _raised(1, 2.0, other), _raised(2, 3.0, echo)])
    assert str(different).startswith(
        "rank 0 of 3 (pid 10) failed: ValueError: bad batch\n"
        "(also failed, independently: rank 1: KeyError: 'label')\n"
        "(then, probably as a consequence: rank 2: RuntimeError: [../gloo/pair.cc:534] "
        "Connection closed by peer)\n\n"
    )
    three = explain([_raised(0, 1.0, cause), _raised(1, 2.0, cause), _raised(2, 3.0, cause)])
    assert "(ranks 1, 2 failed too, independently, with the same error)" in str(three)


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


# ------------------------------------------------------------ arguments at their limits


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
