"""cudakit.parallel at its edges: refused calls leave nothing behind, wrapped models,
FSDP2 state dicts of a submodule really called ``module``, the exit barrier's timeout."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launcher_env import clean_launcher_env, free_port, torchrun_env  # noqa: F401 (autouse fixture)
from torch import nn

import cudakit.parallel as cp
from cudakit import memory_report, memory_snapshot
from cudakit.exceptions import DeviceError


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's environment for a single rank on a free port."""
    env = torchrun_env(1, 0, free_port())
    for k, v in env.items():
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


class Holder(nn.Module):
    """A wrapper whose only child is really called ``module`` (an EMA or task wrapper)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------- refused calls


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
    before = _snapshot(net)
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


# ----------------------------------------------------------- FSDP2 state dict names


def test_fsdp2_state_dict_round_trip_keeps_a_submodule_called_module(one_rank: None) -> None:
    torch.manual_seed(0)
    model = cp.parallelize(Holder(), "fsdp", timeout=30)
    sd = cp.state_dict(model)
    assert sorted(sd) == ["module.0.bias", "module.0.weight", "module.1.bias", "module.1.weight"]
    changed = {k: v + 1 for k, v in sd.items()}
    res = cp.load_state_dict(model, changed)
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    after = cp.state_dict(model)
    assert all(torch.equal(after[k], changed[k]) for k in changed)
    # A checkpoint saved through a DDP wrapper (keys "module.module.0.weight") loads too.
    res = cp.load_state_dict(model, {"module." + k: v for k, v in sd.items()})
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    assert all(torch.equal(cp.state_dict(model)[k], sd[k]) for k in sd)


# ----------------------------------------------------------------- the exit barrier


def test_exit_barrier_waits_under_the_groups_timeout(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(
        dist,
        "monitored_barrier",
        lambda group=None, timeout=None, wait_all_ranks=False: seen.append(timeout),
    )
    with cp.process_group(timeout=7):
        pass
    assert seen == [datetime.timedelta(seconds=7)]


def _slow_rank_one(delay: float) -> float:
    with cp.process_group(timeout=2):
        if cp.rank() == 1:
            time.sleep(delay)
        done = time.monotonic()
    return time.monotonic() - done


def test_a_rank_that_never_reaches_the_exit_is_given_up_on_after_the_timeout() -> None:
    waited_0, _ = cp.launch(_slow_rank_one, 8.0, nprocs=2, timeout=60)
    assert waited_0 < 6.0  # the group's 2 s, not torch's default 30 minutes


# ------------------------------------------------------------ memory device errors


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("func", [memory_report, memory_snapshot], ids=lambda f: f.__name__)
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "mps"])
def test_memory_device_errors_start_with_the_call(func: Any, device: str) -> None:
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(DeviceError) as info:
        func(device=device)
    assert str(info.value).startswith(f"{func.__name__}(device={device!r}): ")


# ------------------------------------------------------ distributed_loader drop_last


def _shards(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> list[list[int]]:
    data = torch.utils.data.TensorDataset(torch.arange(11))
    shards = []
    for r in range(2):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(r))
        loader = cp.distributed_loader(data, batch_size=2, shuffle=True, seed=3, **kwargs)
        loader.sampler.set_epoch(0)  # type: ignore[attr-defined]
        shards.append([int(i) for (batch,) in loader for i in batch])
    return shards


def test_drop_last_repeats_no_sample_across_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _shards(monkeypatch, drop_last=True)
    assert len(a) == len(b) == 4  # 5 each without repeats, then the last half batch dropped
    assert not set(a) & set(b)
    a, b = _shards(monkeypatch)  # drop_last=False: padded with repeats, nothing dropped
    assert len(a) == len(b) == 6
    assert set(a) | set(b) == set(range(11))


def test_numpy_integers_reach_the_loader_as_ints(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    data = torch.utils.data.TensorDataset(torch.arange(8))
    loader = cp.distributed_loader(
        data, batch_size=np.int64(4), seed=np.int64(3), num_workers=np.int64(0)
    )
    assert type(loader.batch_size) is int
    assert type(loader.num_workers) is int
    assert [len(b) for (b,) in loader] == [4, 4]
    from cudakit import loader_kwargs

    kw = loader_kwargs("cpu", num_workers=np.int64(1))
    assert type(kw["num_workers"]) is int
    assert type(kw["persistent_workers"]) is bool


# ------------------------------------------- FSDP2 mid-window autocast_step checkpoints


def _fsdp2_step() -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    """An FSDP2 model (one rank), its optimizer, an accumulate=2 step and its decorated call."""
    import torch.nn.functional as F

    from cudakit import autocast_step

    torch.manual_seed(0)
    model = cp.parallelize(Net(), "fsdp", timeout=30)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = autocast_step(opt, model=model, dtype="fp32", accumulate=2)
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    train = step(lambda: F.cross_entropy(model(x), y))
    return model, opt, step, train


def test_fsdp2_mid_window_checkpoint_is_refused_not_silently_empty(one_rank: None) -> None:
    model, _, step, train = _fsdp2_step()
    boundary = step.state_dict()  # position 0: fine
    train()
    assert step.position == 1
    with pytest.raises(RuntimeError, match=r"state_dict\(\).*FSDP2.*flush\(\)"):
        step.state_dict()
    mid = dict(boundary, position=1, grads=[None] * len(list(model.parameters())))
    with pytest.raises(ValueError, match=r"mid-window.*FSDP2"):
        step.load_state_dict(mid)
    assert step.position == 1
    assert train().stepped
    step.load_state_dict(step.state_dict())  # at a boundary: round trip


# -------------------------------------------------- "auto" still checks option names


def test_auto_on_one_device_refuses_a_misspelt_ddp_option() -> None:
    with pytest.raises(TypeError, match=r"'find_unused_paramters' that DistributedDataParallel"):
        cp.parallelize(nn.Linear(2, 2), device="cpu", find_unused_paramters=True)
    net = nn.Linear(2, 2)
    assert cp.parallelize(net, device="cpu", find_unused_parameters=True) is net  # ignored


# ------------------------------------------- main_process_first before any group


def test_main_process_first_warns_when_launched_ranks_have_no_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    ran = []
    warned = pytest.warns(RuntimeWarning, match=r"no process group is running yet.*process_group")
    with warned, cp.main_process_first():
        ran.append(True)
    assert ran == [True]


def test_main_process_first_is_quiet_in_one_process() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block = cp.main_process_first()
        block.__enter__()
        block.__exit__(None, None, None)


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


def test_auto_checks_a_wrapped_models_options_as_ddp_options() -> None:
    wrapped = nn.DataParallel(nn.Linear(2, 2))
    assert cp.parallelize(wrapped, find_unused_parameters=True) is wrapped


def test_preserve_state_says_when_fsdp2_keeps_a_blocks_gradients(one_rank: None) -> None:
    from cudakit import preserve_state

    model, opt, step, train = _fsdp2_step()
    refused = pytest.raises(RuntimeError, match=r"FSDP2 keeps their gradients inside itself")
    with refused, preserve_state(model, opt, extra=(step,)):
        train()  # half a window, without gradient sync
    with preserve_state(model, opt, extra=(step,)):
        train()
        train()  # a whole window: nothing left inside FSDP2
    assert step.position == 0
