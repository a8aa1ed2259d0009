"""``choose_plan`` and ``ParallelFacts`` (offered in docs/parallel.md) get the same door as
``parallelize``: an unknown request, a backend the plan's device cannot use, or facts of
the wrong kind are clear errors, never a silent ``'none'`` or an ``AttributeError``."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import cudakit.parallel as cp
from cudakit.parallel.strategy import ParallelFacts, check_backend, choose_plan

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


def test_process_group_refuses_nccl_for_a_cpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    from launcher_env import free_port, torchrun_env

    for k, v in torchrun_env(1, 0, free_port()).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)  # as on a CUDA build
    with pytest.raises(
        ValueError,
        match=r"process_group\(backend=\.\.\.\): 'nccl' gives the device cpu no backend",
    ):
        cp.process_group("nccl", device="cpu").__enter__()
    assert not dist.is_initialized()
