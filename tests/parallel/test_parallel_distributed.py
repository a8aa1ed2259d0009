"""Distributed behaviour of cudakit.parallel: two local processes over gloo (and NCCL on GPUs).

Every launched process imports torch, which costs seconds on a small CI machine,
so each launch runs many checks and returns what the parent needs to compare.
"""

from __future__ import annotations

import atexit
import logging
import math
import multiprocessing
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import cudakit.parallel as cp

pytestmark = pytest.mark.distributed

K_STEPS = 6
BATCH = 4
N_SAMPLES = 32


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(N_SAMPLES, 4, generator=g), torch.randn(N_SAMPLES, 1, generator=g)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _sd(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().cpu() for k, v in cp.state_dict(model).items()}


def _reference(batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Single-process SGD on the concatenation of every rank's batch, step by step."""
    x, y = _data()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for idx in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    return _sd(model)


# --------------------------------------------------------------------------- launched bodies


def _ddp_checks(tmp: str) -> dict[str, Any]:
    """Runs on every rank: training, NaN skip, accumulation, state dicts, FSDP2, helpers."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from cudakit.amp import autocast_step

    out: dict[str, Any] = {}
    x, y = _data()
    with cp.process_group(timeout=60) as info:
        r = cp.rank()
        out["info"] = (info.backend, info.rank, info.world_size, info.created, info.timeout)
        out["helpers"] = (cp.rank(), cp.world_size(), cp.local_rank(), cp.is_main_process())

        # (1) k steps with shuffled, sharded data: a plain loop.
        ddp = cp.parallelize(_net())
        out["wrapper"] = type(ddp).__name__
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        loader = cp.distributed_loader(
            torch.utils.data.TensorDataset(x, y, torch.arange(N_SAMPLES)),
            batch_size=BATCH,
            shuffle=True,
        )
        seen: list[torch.Tensor] = []
        epoch_indices: list[list[int]] = []
        while len(seen) < K_STEPS:
            this_epoch: list[int] = []
            for xb, yb, idx in loader:
                if len(seen) == K_STEPS:
                    break
                opt.zero_grad()
                nn.functional.mse_loss(ddp(xb), yb).backward()
                opt.step()
                seen.append(idx)
                this_epoch += idx.tolist()
            epoch_indices.append(this_epoch)
        out["seen"] = seen
        out["epochs"] = epoch_indices
        out["trained"] = _sd(ddp)

        # (4) state dict from the wrapped model loads into a bare one and back.
        sd = cp.state_dict(ddp)
        out["sd_keys"] = sorted(sd)
        bare = _Net()
        cp.load_state_dict(bare, ddp.state_dict())  # prefixed keys into the bare model
        out["bare_matches"] = all(
            torch.equal(a, b) for a, b in zip(bare.state_dict().values(), sd.values(), strict=True)
        )
        with torch.no_grad():
            for p in bare.parameters():
                p.add_(1.0)
        cp.load_state_dict(ddp, bare.state_dict())  # bare keys into the wrapped model
        out["back_matches"] = all(
            torch.equal(a, b)
            for a, b in zip(
                cp.unwrap(ddp).state_dict().values(), bare.state_dict().values(), strict=True
            )
        )

        # (2) NaN loss on rank 0 only (gradients finite): both ranks must skip.
        model = cp.parallelize(_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = autocast_step(opt, model=model, dtype=torch.float32)
        before = _sd(model)
        with step:
            loss = nn.functional.mse_loss(model(x[:8]), y[:8])
            if r == 0:
                loss = loss + torch.tensor(float("nan"))
        res = step.backward(loss)
        out["nan_step"] = (res.stepped, res.skipped)
        out["nan_unchanged"] = all(torch.equal(before[k], v) for k, v in _sd(model).items())
        with step:
            loss = nn.functional.mse_loss(model(x[8:16]), y[8:16])
        res = step.backward(loss)
        out["after_nan_step"] = (res.stepped, res.skipped)
        out["after_nan"] = _sd(model)

        # (3) accumulation: gradients are all-reduced only on stepping calls.
        model = cp.parallelize(_net())
        calls = {"n": 0}

        def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
            state["n"] += 1
            return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

        model.register_comm_hook(calls, counting_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        single = autocast_step(opt, model=model, dtype=torch.float32)
        single(lambda: nn.functional.mse_loss(model(x[:4]), y[:4]))()
        per_backward = calls["n"]
        calls["n"] = 0

        @autocast_step(opt, model=model, dtype=torch.float32, accumulate=4)
        def micro(i: int) -> torch.Tensor:
            return nn.functional.mse_loss(model(x[i : i + 2]), y[i : i + 2])

        stepped = [micro(i).stepped for i in range(8)]
        out["accum"] = (per_backward, calls["n"], stepped)
        out["accum_weights"] = _sd(model)

        # FSDP2 on gloo, in the same (already initialised) group.
        fsdp = cp.parallelize(_net(), "fsdp")
        out["fsdp_dtensor"] = type(next(fsdp.parameters())).__name__
        opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
        for idx in seen[:2]:
            opt.zero_grad()
            nn.functional.mse_loss(fsdp(x[idx]), y[idx]).backward()
            opt.step()
        full = cp.state_dict(fsdp)  # collective; full on rank 0
        out["fsdp_sd"] = {k: v.clone() for k, v in full.items()}
        fresh = cp.parallelize(_net(), "fsdp")
        cp.load_state_dict(fresh, full if r == 0 else {})
        back = cp.state_dict(fresh)
        out["fsdp_roundtrip"] = r != 0 or all(torch.equal(back[k], full[k]) for k in full)

        # main_process_first: rank 0 writes, the others read inside the block.
        marker = Path(tmp) / "download.txt"
        with cp.main_process_first():
            if cp.is_main_process():
                time.sleep(0.3)
                marker.write_text("ready")
            out["mpf"] = marker.read_text()

        # A clean exit waits for every rank before destroying the group: rank 1 is late.
        if r == 1:
            time.sleep(0.5)
        out["body_done"] = time.time()
    out["left"] = time.time()
    out["destroyed"] = not dist.is_initialized()
    return out


def _fail(tmp: str) -> None:
    """Rank 1 raises inside process_group(); rank 0 waits in a collective for it."""
    try:
        with cp.process_group(timeout=60):
            if cp.rank() == 1:
                raise ValueError("boom from rank 1")
            dist.barrier()  # never completes: rank 1 is gone
            time.sleep(60)
    finally:
        (Path(tmp) / f"rank{cp.rank()}.txt").write_text(f"initialized={dist.is_initialized()}")


def _reenter(rounds: int) -> list[tuple[float, float, bool, bool]]:
    """Two training phases and more: process_group() entered ``rounds`` times in a row.

    Each group runs an all_reduce on the default group and one on a new subgroup; the
    last phase is parallelize()'s own group, which launch() tears down.
    """
    out = []
    for i in range(rounds):
        with cp.process_group(timeout=10) as info:
            x = torch.tensor([float(cp.rank() + 1 + i)])
            dist.all_reduce(x)
            y = torch.ones(1)
            dist.all_reduce(y, group=dist.new_group([0, 1]))
            out.append((x.item(), y.item(), info.created, dist.is_initialized()))
        assert not dist.is_initialized()
    model = cp.parallelize(nn.Linear(2, 1))
    nn.functional.mse_loss(model(torch.ones(2, 2)), torch.zeros(2, 1)).backward()
    grad = float(cp.unwrap(model).weight.grad.sum())
    out.append((grad, 0.0, True, dist.is_initialized()))
    return out


def _hang() -> None:
    time.sleep(120)


def _abort_at_exit() -> None:
    os.abort()  # SIGABRT, as gloo's teardown race does ("terminate called without ...")


def _returns_then_aborts(crashing_rank: int) -> int:
    """``crashing_rank`` returns, then dies by SIGABRT while its interpreter shuts down."""
    r = cp.rank()
    if r == crashing_rank:
        atexit.register(_abort_at_exit)
    return r * 10


def _after_failure(flag: str) -> None:
    Path(flag).write_text("reported")  # after the failure message went to the parent
    time.sleep(30)  # stay alive: the peer's signal death is what the parent sees first


def _raise_then_peer_aborts(tmp: str) -> None:
    """Rank 1 raises; rank 0 then dies by a signal while rank 1 is still alive."""
    flag = Path(tmp) / "rank1-reported"
    if cp.rank() == 1:
        atexit.register(_after_failure, str(flag))
        raise ValueError("the real cause, on rank 1")
    deadline = time.monotonic() + 60
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.abort()


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ddp")
    return cp.launch(_ddp_checks, str(tmp), nprocs=2, timeout=180)


def test_launch_environment_and_group(ddp_results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(ddp_results):
        backend, rank, world, created, timeout = res["info"]
        assert (backend, rank, world, created) == ("gloo", r, 2, True)
        assert timeout.total_seconds() == 60
        assert res["helpers"] == (r, 2, r, r == 0)
        assert res["wrapper"] == "DistributedDataParallel"
        assert res["destroyed"]
        assert res["mpf"] == "ready"
    # Clean exit of process_group(): rank 0 left only after the late rank 1 was done.
    assert ddp_results[0]["left"] >= ddp_results[1]["body_done"]


def test_ddp_training_matches_single_process(ddp_results: list[dict[str, Any]]) -> None:
    r0, r1 = ddp_results
    for k in r0["trained"]:
        assert torch.equal(r0["trained"][k], r1["trained"][k]), k  # bitwise across ranks
    batches = [torch.cat([a, b]) for a, b in zip(r0["seen"], r1["seen"], strict=True)]
    ref = _reference(batches)
    for k, v in ref.items():
        torch.testing.assert_close(r0["trained"][k], v, rtol=0, atol=1e-6)


def test_distributed_loader_shards_and_reshuffles(ddp_results: list[dict[str, Any]]) -> None:
    r0, r1 = ddp_results
    first0, first1 = r0["epochs"][0], r1["epochs"][0]
    assert sorted(first0 + first1) == list(range(N_SAMPLES))  # disjoint shards, full cover
    second0 = r0["epochs"][1]
    assert second0 != first0[: len(second0)]  # set_epoch called: a new order


def test_state_dict_roundtrip(ddp_results: list[dict[str, Any]]) -> None:
    for res in ddp_results:
        assert not any(k.startswith("module.") for k in res["sd_keys"])
        assert res["bare_matches"]
        assert res["back_matches"]


def test_nan_on_one_rank_skips_everywhere(ddp_results: list[dict[str, Any]]) -> None:
    r0, r1 = ddp_results
    assert r0["nan_step"] == r1["nan_step"] == (False, True)
    assert r0["nan_unchanged"]
    assert r1["nan_unchanged"]
    assert r0["after_nan_step"] == r1["after_nan_step"] == (True, False)
    for k in r0["after_nan"]:
        assert torch.equal(r0["after_nan"][k], r1["after_nan"][k])
        assert torch.isfinite(r0["after_nan"][k]).all()


def test_accumulation_all_reduces_only_on_stepping_calls(
    ddp_results: list[dict[str, Any]],
) -> None:
    for res in ddp_results:
        per_backward, calls, stepped = res["accum"]
        assert per_backward >= 1
        assert stepped == [False, False, False, True] * 2
        assert calls == 2 * per_backward
    for k in ddp_results[0]["accum_weights"]:
        assert torch.equal(ddp_results[0]["accum_weights"][k], ddp_results[1]["accum_weights"][k])


def test_fsdp2_on_gloo(ddp_results: list[dict[str, Any]]) -> None:
    r0, r1 = ddp_results
    assert r0["fsdp_dtensor"] == "DTensor"
    assert r1["fsdp_sd"] == {}  # full state dict lands on rank 0 only
    batches = [torch.cat([a, b]) for a, b in zip(r0["seen"][:2], r1["seen"][:2], strict=True)]
    ref = _reference(batches)
    for k, v in ref.items():
        torch.testing.assert_close(r0["fsdp_sd"][k], v, rtol=0, atol=1e-6)
    assert r0["fsdp_roundtrip"]
    assert r1["fsdp_roundtrip"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_failing_rank_raises_in_parent_without_hanging(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(cp.LaunchError, match=r"rank 1 of 2 .* failed: ValueError: boom") as ei:
        cp.launch(_fail, str(tmp_path), nprocs=2, timeout=120)
    assert time.monotonic() - start < 45  # seconds (two torch imports), never the 60 s timeout
    err = ei.value
    assert err.rank == 1
    assert "raise ValueError" in err.traceback_text
    assert len(err.pids) == 2
    assert all(_gone(pid) for pid in err.pids)
    assert multiprocessing.active_children() == []
    assert (tmp_path / "rank1.txt").read_text() == "initialized=False"


def test_process_group_reentered_under_launch() -> None:
    # The launch parent holds the store for the whole launch (TORCHELASTIC_USE_AGENT_STORE,
    # as torchrun's agent does), so every group after the first used to find the previous
    # group's gloo addresses there: 6 launches in 10 failed ("Connection refused") or hung.
    start = time.monotonic()
    r0, r1 = cp.launch(_reenter, 4, nprocs=2, timeout=60)
    # A hang ends at the launch timeout (60 s); 4 groups took 10 to 40 s on the loaded machine.
    assert time.monotonic() - start < 55
    assert r0[:4] == r1[:4] == [(3.0 + 2 * i, 2.0, True, True) for i in range(4)]
    assert r0[4] == r1[4]  # the DDP gradients are all-reduced: equal on both ranks
    assert multiprocessing.active_children() == []


def test_launch_keeps_results_of_a_rank_that_dies_at_shutdown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="cudakit"):
        assert cp.launch(_returns_then_aborts, 1, nprocs=2, timeout=120) == [0, 10]
    assert "rank 1 returned its result, then died while shutting down" in caplog.text
    assert "SIGABRT" in caplog.text
    assert multiprocessing.active_children() == []


def test_launch_prefers_a_python_exception_to_a_peer_signal(tmp_path: Path) -> None:
    with pytest.raises(
        cp.LaunchError, match=r"rank 1 of 2 .* failed: ValueError: the real cause, on rank 1"
    ) as ei:
        cp.launch(_raise_then_peer_aborts, str(tmp_path), nprocs=2, timeout=120)
    assert ei.value.rank == 1
    assert "raise ValueError" in ei.value.traceback_text
    assert all(_gone(pid) for pid in ei.value.pids)
    assert multiprocessing.active_children() == []


def test_launch_unpicklable_arguments_is_clear_and_leaves_no_process() -> None:
    with pytest.raises(
        TypeError,
        match=r"launch\(\) must send fn's arguments to new processes, but they cannot be "
        r"pickled \(cannot pickle '_thread.lock' object\)\. Pass plain data",
    ):
        cp.launch(_returns_then_aborts, threading.Lock(), nprocs=2)
    assert multiprocessing.active_children() == []


def test_launch_stops_ranks_started_before_a_start_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.multiprocessing as mp

    def start_one_then_fail(*args: Any, **kwargs: Any) -> None:
        multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,)).start()
        raise OSError("[Errno 24] Too many open files")

    monkeypatch.setattr(mp, "start_processes", start_one_then_fail)
    start = time.monotonic()
    with pytest.raises(OSError, match=r"Too many open files"):
        cp.launch(_hang, nprocs=2)
    assert multiprocessing.active_children() == []
    assert time.monotonic() - start < 30


def _unpicklable_result_on_rank_0() -> Any:
    return (lambda: None) if cp.rank() == 0 else 1


def _exit_zero_on_rank_1() -> int:
    if cp.rank() == 1:
        sys.exit(0)
    return 0


def _forked(fn: Any) -> Any:
    # fork: the ranks start at once (torch is already imported). Python 3.12+ warns about
    # fork in a multi-threaded process; these ranks run no threads of their own.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cp.launch(fn, nprocs=2, timeout=60, start_method="fork")


def test_launch_fork_messages_for_results_that_cannot_come_back() -> None:
    with pytest.raises(
        cp.LaunchError,
        match=r"rank 0 of 2 .* failed: TypeError: launch\(\): rank 0's return value of type "
        r"function cannot be pickled back to the parent .*; return plain data",
    ):
        _forked(_unpicklable_result_on_rank_0)
    with pytest.raises(
        cp.LaunchError,
        match=r"rank 1 of 2 \(pid \d+\) exited with code 0 without returning a result "
        r"\(sys.exit\(0\)",
    ) as ei:
        _forked(_exit_zero_on_rank_1)
    assert ei.value.rank == 1
    assert multiprocessing.active_children() == []


def test_launch_timeout_kills_every_rank() -> None:
    start = time.monotonic()
    with pytest.raises(cp.LaunchError, match=r"timed out after 2s") as ei:
        cp.launch(_hang, nprocs=1, timeout=2)
    assert time.monotonic() - start < 30
    assert all(_gone(pid) for pid in ei.value.pids)
    assert multiprocessing.active_children() == []


# --------------------------------------------------------------------------- GPUs


def _nccl_checks() -> dict[str, Any]:
    ddp = cp.parallelize(_net())
    dev = next(ddp.parameters()).device
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = _data()
    r = cp.rank()
    idx = torch.arange(r * BATCH, (r + 1) * BATCH)
    nn.functional.mse_loss(ddp(x[idx].to(dev)), y[idx].to(dev)).backward()
    opt.step()
    backend = dist.get_backend()
    return {
        "device": str(dev),
        "current": torch.cuda.current_device(),
        "backend": backend,
        "weights": _sd(ddp),
        "finite": math.isfinite(float(sum(p.sum() for p in ddp.parameters()))),
    }


@pytest.mark.multigpu
def test_ddp_nccl_one_gpu_per_rank() -> None:
    r0, r1 = cp.launch(_nccl_checks, nprocs=2, timeout=300)
    assert (r0["device"], r1["device"]) == ("cuda:0", "cuda:1")
    assert (r0["current"], r1["current"]) == (0, 1)
    assert r0["backend"] == r1["backend"] == "nccl"
    for k in r0["weights"]:
        assert torch.equal(r0["weights"][k], r1["weights"][k])
    ref = _reference([torch.arange(0, 2 * BATCH)])
    for k, v in ref.items():
        torch.testing.assert_close(r0["weights"][k], v, rtol=1e-5, atol=1e-5)


@pytest.mark.multigpu
def test_dataparallel_on_gpus() -> None:
    net = cp.parallelize(_net(), "dp")
    assert isinstance(net, nn.DataParallel)
    assert net.device_ids == list(range(torch.cuda.device_count()))
    x, _ = _data()
    out = net(x.cuda())
    assert out.shape == (N_SAMPLES, 1)
    assert out.device == torch.device("cuda", 0)
    auto = cp.parallelize(_net())  # one process, several GPUs: DataParallel
    assert isinstance(auto, nn.DataParallel)
    assert cp.unwrap(auto).head.weight.device == torch.device("cuda", 0)
