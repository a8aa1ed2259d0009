"""cudakit.parallel on one CPU process: the decision, errors, helpers, in-process groups."""

from __future__ import annotations

import datetime
import itertools
import logging
import warnings
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from launcher_env import clean_launcher_env, free_port, torchrun_env  # noqa: F401 (autouse fixture)
from torch import nn

import cudakit.parallel as cp
from cudakit.exceptions import CudakitError, DeviceError, DistributedSetupError
from cudakit.parallel import group as cp_group
from cudakit.parallel import unwrapped
from cudakit.parallel._failures import RankEnd, explain, shutdown_notes


@pytest.fixture
def single_rank_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = torchrun_env(1, 0, free_port())
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


# --------------------------------------------------------------------------- choose_strategy

ENVS: dict[str, dict[str, str]] = {
    "none": {},
    "torchrun1": torchrun_env(1),
    "torchrun2": torchrun_env(2, 1),
    "torchrun4": torchrun_env(4, 3),
    "partial_multi": {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
    "partial_single": {"WORLD_SIZE": "1", "LOCAL_RANK": "0"},
    "stray_local_rank": {"LOCAL_RANK": "0"},
}
REQUESTS = ("auto", "none", "dp", "ddp", "fsdp")
COUNTS = (0, 1, 2, 8)
TYPES = ("cpu", "cuda", "mps")
GROUPS = (None, 1, 2)


def _oracle(req: str, env: str, n: int, dev: str, group: int | None) -> str | type[Exception]:
    """The documented rules, written out independently of the implementation."""
    if group is not None:
        world: int | None = group
    elif env == "partial_multi":
        return DistributedSetupError
    elif env in ("partial_single", "stray_local_rank"):
        if req in ("ddp", "fsdp"):
            return DistributedSetupError
        world = None
    else:
        world = None if env == "none" else int(ENVS[env]["WORLD_SIZE"])
    if world is not None and world > 1:
        if req == "dp":
            return DistributedSetupError
        return "ddp" if req == "auto" else req
    if req == "auto":
        return "dp" if dev == "cuda" and n > 1 else "none"
    if req == "dp":
        return "dp" if dev == "cuda" and n > 0 else DeviceError
    if req in ("ddp", "fsdp"):
        return req if world is not None else DistributedSetupError
    return "none"


def test_choose_strategy_every_combination() -> None:
    combos = list(itertools.product(REQUESTS, ENVS, COUNTS, TYPES, GROUPS))
    assert len(combos) == 5 * 7 * 4 * 3 * 3
    for req, env, n, dev, group in combos:
        expected = _oracle(req, env, n, dev, group)
        kwargs: dict[str, Any] = {
            "env": ENVS[env],
            "device_count": n,
            "device_type": dev,
            "group_world_size": group,
        }
        if isinstance(expected, str):
            assert cp.choose_strategy(req, **kwargs) == expected, (req, env, n, dev, group)
        else:
            with pytest.raises(expected):
                cp.choose_strategy(req, **kwargs)


def test_auto_never_errors_for_complete_or_absent_launchers() -> None:
    complete = ("none", "torchrun1", "torchrun2", "torchrun4", "partial_single")
    for env, n, dev, group in itertools.product(complete, COUNTS, TYPES, GROUPS):
        got = cp.choose_strategy(
            "auto", env=ENVS[env], device_count=n, device_type=dev, group_world_size=group
        )
        assert got in ("none", "dp", "ddp")


def test_choose_strategy_error_messages() -> None:
    with pytest.raises(
        DistributedSetupError,
        match=r"'ddp' needs one process per GPU .* `torchrun --nproc-per-node N script.py`",
    ):
        cp.choose_strategy("ddp", env={}, device_count=2, device_type="cuda")
    with pytest.raises(DeviceError, match=r"'dp' \(DataParallel\) needs CUDA devices, but this"):
        cp.choose_strategy("dp", env={}, device_count=0, device_type="cpu")
    with pytest.raises(DeviceError, match=r"the model's device is 'cpu'.* device='cuda'"):
        cp.choose_strategy("dp", env={}, device_count=2, device_type="cpu")
    with pytest.raises(DistributedSetupError, match=r"'dp' \(DataParallel\) inside a launch of 2"):
        cp.choose_strategy("dp", env=torchrun_env(2), device_count=2, device_type="cuda")
    with pytest.raises(
        DistributedSetupError,
        match=r"incomplete launcher environment: WORLD_SIZE, RANK, LOCAL_RANK set but "
        r"MASTER_ADDR, MASTER_PORT missing\. .*torchrun --nproc-per-node 2 script\.py",
    ):
        cp.choose_strategy("auto", env=ENVS["partial_multi"], device_count=0, device_type="cpu")


# --------------------------------------------------------------------------- read_env


def test_read_env_values_and_errors() -> None:
    assert cp.read_env({}) is None
    assert cp.read_env({"LOCAL_RANK": "0"}) is None  # stray variable, single process
    env = cp.read_env({**torchrun_env(4, 3), "LOCAL_WORLD_SIZE": "4"})
    assert env == cp.DistributedEnv(3, 4, 3, 4, "127.0.0.1", 29500)
    cases = [
        ({**torchrun_env(2), "RANK": "one"}, r"RANK='one' is not an integer"),
        ({**torchrun_env(2), "RANK": "2"}, r"RANK=2 but WORLD_SIZE=2: ranks run from 0"),
        ({**torchrun_env(2), "WORLD_SIZE": "0"}, r"WORLD_SIZE=0 must be >= 1"),
        (
            {**torchrun_env(2, 1), "LOCAL_WORLD_SIZE": "1"},
            r"LOCAL_RANK=1 but LOCAL_WORLD_SIZE=1",
        ),
        ({**torchrun_env(2), "MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a TCP port"),
    ]
    for bad, match in cases:
        with pytest.raises(DistributedSetupError, match=match):
            cp.read_env(bad)


def test_read_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in torchrun_env(2, 1).items():
        monkeypatch.setenv(k, v)
    env = cp.read_env()
    assert env is not None
    assert (env.rank, env.world_size) == (1, 2)


# --------------------------------------------------------------------------- parallelize (CPU)


def test_parallelize_cpu_passthrough_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    net = nn.Linear(3, 2)
    with caplog.at_level(logging.INFO, logger="cudakit"):
        out = cp.parallelize(net, device="cpu")
    assert out is net
    records = [r for r in caplog.records if r.name == "cudakit"]
    assert len(records) == 1
    assert "single device cpu" in records[0].getMessage()


def test_parallelize_auto_ignores_ddp_kwargs_with_a_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="cudakit"):
        cp.parallelize(nn.Linear(3, 2), device="cpu", find_unused_parameters=True)
    assert "DDP options {'find_unused_parameters': True} ignored" in caplog.text


def test_parallelize_partial_env_errors_even_for_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    net = nn.Linear(2, 2)
    before = net.weight.detach().clone()
    with pytest.raises(DistributedSetupError, match=r"LOCAL_RANK, MASTER_ADDR, MASTER_PORT"):
        cp.parallelize(net)
    assert torch.equal(net.weight, before)


def test_parallelize_returns_wrapped_models_unchanged() -> None:
    dp = nn.DataParallel(nn.Linear(2, 2))
    assert cp.parallelize(dp) is dp


def test_parallelize_ddp_single_rank_group(
    single_rank_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    net = nn.Linear(3, 1)
    with caplog.at_level(logging.INFO, logger="cudakit"):
        ddp = cp.parallelize(net, "ddp", timeout=30, gradient_as_bucket_view=True)
    infos = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(infos) == 1, infos  # the decision, logged once (with the group it created)
    assert (
        "-> DDP on cpu (rank 0 of 1, backend gloo, process group created, timeout 30s)"
        in (infos[0])
    )
    assert isinstance(ddp, nn.parallel.DistributedDataParallel)
    assert cp.unwrap(ddp) is net
    assert dist.is_initialized()
    assert dist.get_backend() == "gloo"
    assert (cp.rank(), cp.world_size(), cp.is_main_process()) == (0, 1, True)
    auto = cp.parallelize(nn.Linear(3, 1))  # existing group of one: auto -> ddp (world 1: none)
    assert isinstance(auto, nn.Linear)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match=r"needs a model with trainable parameters"):
        cp.parallelize(frozen, "ddp")
    with pytest.raises(TypeError, match=r"'bogus' that DistributedDataParallel does not accept"):
        cp.parallelize(nn.Linear(2, 2), "ddp", bogus=1)
    sd = ddp.state_dict()
    assert list(sd) == ["module.weight", "module.bias"]
    assert list(cp.state_dict(ddp)) == ["weight", "bias"]


# --------------------------------------------------------------------------- process_group


def test_process_group_lifecycle(single_rank_env: dict[str, str]) -> None:
    with cp.process_group(timeout=datetime.timedelta(seconds=42)) as info:
        assert info.created
        assert (info.backend, info.rank, info.world_size) == ("gloo", 0, 1)
        assert info.timeout.total_seconds() == 42
        with cp.process_group() as inner:  # nested: uses the group, leaves it alone
            assert not inner.created
        assert dist.is_initialized()
    assert not dist.is_initialized()
    cp_group.teardown_owned_group()  # double teardown never raises
    cp_group.teardown_owned_group()


def test_process_group_destroyed_after_exception(single_rank_env: dict[str, str]) -> None:
    with pytest.raises(KeyError), cp.process_group():
        raise KeyError("boom")
    assert not dist.is_initialized()


def test_process_group_as_decorator(single_rank_env: dict[str, str]) -> None:
    @cp.process_group(timeout=30)
    def body() -> bool:
        return dist.is_initialized()

    assert body()
    assert not dist.is_initialized()


def test_process_group_leaves_user_groups_alone(single_rank_env: dict[str, str]) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    try:
        with cp.process_group() as info:
            assert not info.created
        assert dist.is_initialized()
        cp_group.teardown_owned_group()  # not cudakit's: the atexit net does not touch it either
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def _pretend_two_ranks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A one-process group that reports two ranks, with the exit barrier recorded."""
    calls: list[str] = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(cp_group, "_exit_barrier", lambda: calls.append("barrier"))
    return calls


def test_process_group_clean_exit_waits_for_the_other_ranks(
    single_rank_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _pretend_two_ranks(monkeypatch)
    with cp.process_group():
        pass
    assert calls == ["barrier"]  # clean exit: the ranks meet before the group goes away
    assert not dist.is_initialized()
    with pytest.raises(KeyError), cp.process_group():
        raise KeyError("boom")
    assert calls == ["barrier"]  # after an exception: no barrier, the peers may be gone
    assert not dist.is_initialized()


def test_process_group_exit_barrier_failure_still_destroys(
    single_rank_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def peer_gone() -> None:
        raise RuntimeError("Rank 1 failed to pass monitoredBarrier")

    monkeypatch.setattr(cp_group, "_exit_barrier", peer_gone)
    with caplog.at_level(logging.WARNING, logger="cudakit"), cp.process_group():
        pass
    assert not dist.is_initialized()
    assert "not every rank reached the end of its work" in caplog.text
    assert "Rank 1 failed to pass monitoredBarrier" in caplog.text


@pytest.mark.parametrize("agent_store", [True, False], ids=["agent-store", "rank0-store"])
def test_process_group_reentered_uses_fresh_keys_on_one_store(
    agent_store: bool, single_rank_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch names every new default group "0" again, so a second group on the same store
    # used to read the first one's keys (gloo addresses of peers that had moved on).
    if agent_store:  # torchrun / launch(): the store lives in the parent, outside the ranks
        tcp_store = dist.TCPStore  # type: ignore[attr-defined]
        agent = tcp_store("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        monkeypatch.setenv("MASTER_PORT", str(agent.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", str(agent_store))
    made: list[object] = []
    rendezvous = dist.rendezvous  # type: ignore[attr-defined]

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(args)
        return rendezvous(*args, **kwargs)

    monkeypatch.setattr(dist, "rendezvous", counting)
    for _ in range(3):
        with cp.process_group(timeout=10):
            x = torch.ones(1)
            dist.all_reduce(x)
        assert not dist.is_initialized()
    assert len(made) == 1  # one store for the process: rank 0's server never restarts
    assert cp_group._state.store is not None
    store = agent if agent_store else cp_group._state.store[1]
    keys = store.list_keys()
    generations = {k.split("/")[1] for k in keys if k.startswith("cudakit/")}
    assert len(generations) == 3, keys  # every group wrote under its own prefix
    assert all(k.startswith("cudakit/") for k in keys if k != "init/"), keys


def test_exit_barrier_single_rank_gloo(single_rank_env: dict[str, str]) -> None:
    with cp.process_group():
        cp_group._exit_barrier()  # monitored_barrier on gloo: returns at once with one rank


def test_nccl_unavailable_is_clear(single_rank_env: dict[str, str]) -> None:
    if dist.is_nccl_available():
        pytest.skip("this torch has NCCL")
    with pytest.raises(DistributedSetupError, match=r"backend='nccl' is not available"):
        cp.process_group("nccl", device="cpu").__enter__()


# --------------------------------------------------------------------------- rank helpers


def test_rank_helpers_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (cp.rank(), cp.world_size(), cp.local_rank(), cp.is_main_process()) == (0, 1, 0, True)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert (cp.rank(), cp.world_size(), cp.local_rank()) == (3, 4, 0)
    assert not cp.is_main_process()
    assert cp.is_main_process(local=True)


def test_main_process_first_without_group() -> None:
    ran = []
    with cp.main_process_first():
        ran.append(1)

    @cp.main_process_first(local=True)
    def f() -> int:
        return 2

    assert f() == 2
    assert ran == [1]
    with pytest.raises(TypeError, match=r"local=\.\.\.\) expects True or False, got int"):
        cp.main_process_first(local=1)  # type: ignore[arg-type]


def test_main_process_first_single_rank_group(single_rank_env: dict[str, str]) -> None:
    with cp.process_group(), cp.main_process_first():
        assert cp.is_main_process()


# --------------------------------------------------------------------------- unwrap / state


def _compile(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():  # torch's own import-time deprecation noise
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.compile(model)  # type: ignore[return-value]  # not called: no compile


def test_unwrap_nested_wrappers() -> None:
    net = nn.Linear(2, 2)
    assert cp.unwrap(net) is net
    compiled = _compile(net)
    assert cp.unwrap(compiled) is net
    nested = nn.DataParallel(_compile(nn.DataParallel(net)))
    assert cp.unwrap(nested) is net
    with pytest.raises(TypeError, match=r"unwrap\(model=\.\.\.\) expects an nn.Module, got dict"):
        cp.unwrap({})  # type: ignore[arg-type]


class _HasModuleAttr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)  # a submodule really named "module"
        self.bn = nn.BatchNorm1d(2)


def test_state_dict_keeps_real_module_names_and_metadata() -> None:
    own = _HasModuleAttr()
    wrapped = nn.DataParallel(_compile(nn.DataParallel(own)))
    sd = wrapped.state_dict()
    assert next(iter(sd)).startswith("module._orig_mod.module.module.")
    target = _HasModuleAttr()
    res = cp.load_state_dict(target, sd)
    assert res == ([], [])
    for a, b in zip(target.state_dict().values(), own.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # bare keys of a model with a `module` submodule load unchanged
    assert cp.load_state_dict(target, own.state_dict()) == ([], [])
    assert list(cp.state_dict(wrapped)) == list(own.state_dict())
    # the input is not modified
    assert next(iter(sd)).startswith("module.")


_names = st.text(alphabet="abcxyz_", min_size=1, max_size=6).filter(
    lambda s: s not in ("module", "_orig_mod")
)
_keys = st.lists(
    st.lists(_names, min_size=1, max_size=3).map(".".join), min_size=1, max_size=6, unique=True
)
_stacks = st.lists(st.sampled_from(["module.", "_orig_mod."]), max_size=4)


@given(keys=_keys, stack=_stacks, lead=st.booleans())
def test_strip_prefixes_property(keys: list[str], stack: list[str], lead: bool) -> None:
    own = [("module." + k if lead else k) for k in keys]  # maybe a real `module` submodule
    prefix = "".join(stack)
    sd: OrderedDict[str, int] = OrderedDict((prefix + k, i) for i, k in enumerate(own))
    out = unwrapped._strip(sd, set(own))
    assert list(out) == own
    assert list(out.values()) == list(range(len(own)))
    assert list(sd) == [prefix + k for k in own]  # untouched


# --------------------------------------------------------------------------- distributed_loader


def test_distributed_loader_single_process_reshuffles_each_epoch() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(64))
    loader = cp.distributed_loader(data, batch_size=8, seed=3)
    assert len(loader) == 8
    assert loader.batch_size == 8
    assert loader.dataset is data
    first = torch.cat([b[0] for b in loader]).tolist()
    second = torch.cat([b[0] for b in loader]).tolist()
    assert sorted(first) == sorted(second) == list(range(64))
    assert first != second
    assert loader.epoch == 2
    loader.set_epoch(0)
    assert torch.cat([b[0] for b in loader]).tolist() == first  # resumable
    assert "next_epoch=1" in repr(loader)
    with pytest.raises(ValueError, match=r"epoch=\.\.\.\) expects an int >= 0, got int -1"):
        loader.set_epoch(-1)


def test_distributed_loader_shards_by_env_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    data = torch.utils.data.TensorDataset(torch.arange(10))
    shards = []
    for r in range(2):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", "2")
        loader = cp.distributed_loader(data, batch_size=5, shuffle=False)
        shards.append(torch.cat([b[0] for b in loader]).tolist())
    assert shards == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


# --------------------------------------------------------------------------- launch failures


def test_launch_signal_death_outcomes() -> None:
    # rank 0 returned, then died by SIGABRT while shutting down (gloo's teardown race)
    died = RankEnd(0, 4242, -6, True, ended_at=1.0)
    assert explain([died, RankEnd(1, 4343, 0, True, ended_at=1.5)]) is None
    assert shutdown_notes([died]) == [
        "rank 0 returned its result, then died while shutting down (killed by SIGABRT, exit "
        "code -6); the results are kept"
    ]
    err = explain([died, RankEnd(1, 4343, -15, False)])  # rank 1 stopped before returning
    assert isinstance(err, cp.LaunchError)
    assert str(err) == (
        "rank 0 of 2 (pid 4242) returned its result, then died while shutting down (killed by "
        "SIGABRT, exit code -6). Look for a crash in native code (a segfault or an abort) in its "
        "output.\n(launch() then stopped the ranks still running: 1)"
    )
    assert (err.rank, err.pid, err.exitcode, err.pids) == (0, 4242, -6, [4242, 4343])
    err = explain([RankEnd(0, 4242, -6, False, ended_at=1.0)])
    assert err is not None
    assert str(err).startswith(
        "rank 0 of 1 (pid 4242) was killed by SIGABRT (exit code -6) without a Python "
        "exception, before returning its result. Look for"
    )
    cause = "Traceback (most recent call last):\n  ...\nValueError: the real cause\n"
    err = explain(
        [RankEnd(0, 4242, -6, False, ended_at=6.0), RankEnd(1, 4343, 1, False, cause, 5.0, 5.1)]
    )
    assert err is not None
    assert err.rank == 1
    assert str(err).startswith("rank 1 of 2 (pid 4343) failed: ValueError: the real cause")


def test_launch_names_the_cause_not_its_echo() -> None:
    echo = "Traceback ...\nRuntimeError: [../gloo/pair.cc:534] Connection closed by peer\n"
    cause = "Traceback ...\n  raise ValueError\nValueError: bad batch\n"
    err = explain(
        [RankEnd(0, 10, 1, False, echo, 1.0, 1.1), RankEnd(1, 11, 1, False, cause, 2.0, 2.1)]
    )
    assert err is not None
    assert err.rank == 1  # reported later, but rank 0's error is only the echo of it
    assert str(err).startswith(
        "rank 1 of 2 (pid 11) failed: ValueError: bad batch\n(then, probably as a consequence: "
        "rank 0: RuntimeError: [../gloo/pair.cc:534] Connection closed by peer)"
    )
    assert err.traceback_text == cause
    both = explain(
        [RankEnd(0, 10, 1, False, cause, 2.0, 2.1), RankEnd(1, 11, 1, False, cause, 1.0, 1.1)]
    )
    assert both is not None
    assert both.rank == 1  # two real failures: the earlier one


def test_error_hierarchy() -> None:
    assert issubclass(cp.LaunchError, CudakitError)
    assert issubclass(cp.LaunchError, RuntimeError)


# --------------------------------------------------------------------------- one GPU


@pytest.mark.cuda
def test_parallelize_one_gpu() -> None:
    net = cp.parallelize(nn.Linear(2, 2), "none")
    assert net.weight.device == torch.device("cuda", 0)
    if torch.cuda.device_count() == 1:
        assert isinstance(cp.parallelize(nn.Linear(2, 2)), nn.Linear)
        dp = cp.parallelize(nn.Linear(2, 2), "dp")
        assert isinstance(dp, nn.DataParallel)
        assert dp(torch.ones(3, 2, device="cuda")).shape == (3, 2)
