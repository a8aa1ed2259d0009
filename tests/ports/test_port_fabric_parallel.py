"""parallelize, choose_strategy and state dicts against Lightning Fabric's tests.

Ported from Lightning Fabric tests_fabric/connector/test_connector.py (strategy
choice), tests_fabric/strategies/test_ddp.py (test_ddp_process_group_backend,
test_ddp_module_state_dict, test_ddp_extra_kwargs: options reach the wrapper, unknown
ones are refused) and tests_fabric/test_fabric.py (test_setup_module_move_to_device,
in one CPU process).
"""

from __future__ import annotations

import copy

import pytest
import torch
from launcher_env import clean_launcher_env, torchrun_env  # noqa: F401 (autouse fixture)
from torch import nn

import cudakit.parallel as cp
from cudakit.exceptions import DeviceError, DistributedSetupError
from cudakit.parallel.strategy import ParallelFacts, choose_plan

TORCHRUN = torchrun_env(2)


@pytest.mark.parametrize(
    ("strategy", "env", "count", "device_type", "expected"),
    [
        ("auto", {}, 0, "cpu", "none"),
        ("auto", {}, 1, "cuda", "none"),
        ("auto", {}, 2, "cuda", "dp"),
        ("auto", TORCHRUN, 0, "cpu", "ddp"),
        ("auto", TORCHRUN, 2, "cuda", "ddp"),
        ("ddp", TORCHRUN, 0, "cpu", "ddp"),
        ("fsdp", TORCHRUN, 2, "cuda", "fsdp"),
        ("none", {}, 2, "cuda", "none"),
        ("auto", {}, 0, "mps", "none"),
    ],
)
def test_choose_strategy(
    strategy: str, env: dict[str, str], count: int, device_type: str, expected: str
) -> None:
    got = cp.choose_strategy(strategy, env=env, device_count=count, device_type=device_type)
    assert got == expected


@pytest.mark.parametrize(
    ("strategy", "env", "count", "device_type", "error", "match"),
    [
        ("dp", {}, 0, "cpu", DeviceError, "needs CUDA devices"),
        ("dp", TORCHRUN, 2, "cuda", DistributedSetupError, "inside a launch of 2 processes"),
        ("ddp", {}, 2, "cuda", DistributedSetupError, "started by a launcher"),
        ("fsdp", {}, 0, "cpu", DistributedSetupError, "started by a launcher"),
        (
            "auto",
            {"WORLD_SIZE": "2", "RANK": "0"},
            0,
            "cpu",
            DistributedSetupError,
            "incomplete launcher environment",
        ),
        # Fabric's spawn strategies: cudakit.launch() spawns, parallelize() does not.
        ("ddp_spawn", {}, 0, "cpu", ValueError, "got str 'ddp_spawn'"),
        ("bogus", {}, 0, "cpu", ValueError, "got str 'bogus'"),
    ],
)
def test_choose_strategy_errors(
    strategy: str,
    env: dict[str, str],
    count: int,
    device_type: str,
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        cp.choose_strategy(strategy, env=env, device_count=count, device_type=device_type)


@pytest.mark.parametrize(
    ("backend", "cuda", "expected"),
    [("foo", False, "foo"), ("foo", True, "foo"), (None, True, "nccl"), (None, False, "gloo")],
)
def test_ddp_process_group_backend(backend: str | None, cuda: bool, expected: str) -> None:
    facts = ParallelFacts(
        env=cp.read_env(torchrun_env(2, rank=1)),
        group_world_size=None,
        cuda_available=cuda,
        device_count=2,
        current_cuda_index=0 if cuda else None,
        requested_device=None,
        best_device=torch.device("cuda", 0) if cuda else torch.device("cpu"),
    )
    plan = choose_plan("auto", facts, backend=backend)
    assert plan.strategy == "ddp"
    assert plan.backend == expected
    if cuda:
        assert plan.device == torch.device("cuda", 1)  # LOCAL_RANK


def test_ddp_module_state_dict_without_prefix() -> None:
    model = nn.Linear(2, 3)
    plain = copy.deepcopy(model.state_dict())
    assert list(cp.state_dict(model)) == list(plain)
    dp = nn.DataParallel(model)
    assert list(cp.state_dict(dp)) == list(plain)
    cp.load_state_dict(dp, cp.state_dict(dp))
    cp.load_state_dict(dp, plain)
    cp.load_state_dict(model, dp.state_dict())  # "module."-prefixed keys
    compiled = torch.compile(dp)
    assert list(cp.state_dict(compiled)) == list(plain)
    fresh = nn.Linear(2, 3)
    cp.load_state_dict(fresh, compiled.state_dict())  # "_orig_mod.module."-prefixed keys
    assert torch.equal(fresh.weight, model.weight)


def test_submodule_called_module_kept() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    outer = Outer()
    assert list(cp.state_dict(outer)) == ["module.weight", "module.bias"]
    other = Outer()
    cp.load_state_dict(other, outer.state_dict())
    assert torch.equal(other.module.weight, outer.module.weight)


def test_setup_module_on_cpu() -> None:
    net = nn.Linear(2, 2)
    assert cp.parallelize(net, device="cpu") is net
    with pytest.raises(DeviceError, match="needs CUDA devices"):
        cp.parallelize(nn.Linear(2, 2), "dp", device="cpu")
    with pytest.raises(DistributedSetupError, match="started by a launcher"):
        cp.parallelize(nn.Linear(2, 2), "ddp", device="cpu")


def test_model_on_meta_device_is_built_on_the_device() -> None:
    # Fabric refuses a meta-device model here; cudakit builds it where it runs, each
    # submodule by its own reset_parameters() (see docs/big-models.md).
    with torch.device("meta"):
        big = nn.Linear(2, 2)
    model = cp.parallelize(big, device="cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert not torch.equal(model.weight, torch.zeros_like(model.weight))


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"timeout": -1}, ValueError),
        ({"timeout": float("inf")}, ValueError),
        ({"backend": 3}, TypeError),
        ({"device": "gpu"}, DeviceError),
    ],
)
def test_bad_arguments_refused(bad: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error, match=r"parallelize\("):
        cp.parallelize(nn.Linear(2, 2), **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["auto", "none"])
def test_misspelt_ddp_option_refused_on_single_device(strategy: str) -> None:
    """Refused at the door on a laptop too, not only once the script runs under torchrun."""
    with pytest.raises(TypeError, match="find_unused_paramters"):
        cp.parallelize(nn.Linear(2, 2), strategy, device="cpu", find_unused_paramters=True)
