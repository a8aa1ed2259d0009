"""The pure plan behind ``parallelize`` (``choose_plan``) over every combination of facts,
the device each rank gets (``rank_device``), and the facts read from this process
(``gather_facts``)."""

from __future__ import annotations

import itertools

import pytest
import torch
from launcher_env import clean_launcher_env  # noqa: F401 (autouse fixture)

import cudakit.parallel as cp
from cudakit.exceptions import DeviceError, DistributedSetupError
from cudakit.parallel.strategy import ParallelFacts, choose_plan, gather_facts, rank_device

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
