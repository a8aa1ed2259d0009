"""autocast_step across two gloo processes: FSDP2 (fully_shard) and DDP token weighting.

One launch runs every check and saves what the parent compares (spawning costs
seconds on a small machine). Free port, finite timeouts.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from launcher_env import join_gloo, run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
        torch.nn.Linear(8, 1),
    )  # fmt: skip


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(3, WORLD * 4, 4, generator=g), torch.randn(3, WORLD * 4, 1, generator=g)


def _reference() -> dict[str, torch.Tensor]:
    """One process, the full batch of every window, clipped, SGD."""
    xs, ys = _data()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _count_reduce_scatters() -> list[int]:
    import torch.distributed as dist

    calls = [0]
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        real = getattr(dist, name, None)
        if real is None:
            continue

        def counting(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            calls[0] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counting)
    return calls


def _worker(rank: int, port: int, out: str) -> None:
    import cudakit.amp._stepper as amp_stepper
    import cudakit.parallel as cp
    from cudakit.amp import autocast_step

    join_gloo(rank, port, WORLD)
    results: dict[str, Any] = {}
    try:
        calls = _count_reduce_scatters()
        xs, ys = _data()
        mine = slice(rank * 4, rank * 4 + 4)
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).split(".")[-1]
            model = cp.parallelize(_net(), "fsdp")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            step = autocast_step(opt, model=model, dtype=dtype, accumulate=2, max_grad_norm=0.5)

            @step
            def train(
                x: torch.Tensor, y: torch.Tensor, poison: bool = False, net: Any = model
            ) -> torch.Tensor:
                loss = F.mse_loss(net(x).float(), y)
                return loss * float("nan") if poison else loss

            per_window = []
            for x, y in zip(xs, ys, strict=True):
                before = calls[0]
                x, y = x[mine], y[mine]
                r1 = train(x[:2], y[:2])
                r2 = train(x[2:], y[2:])
                assert (r1.stepped, r2.stepped) == (False, True)
                per_window.append(calls[0] - before)
            results[f"{name}_rs_per_window"] = per_window
            results[f"{name}_weights"] = {
                k: v.detach().clone() for k, v in cp.state_dict(model).items()
            }
            # A NaN on rank 1 only: every rank skips, weights unchanged.
            snap = [p.detach().to_local().clone() for p in model.parameters()]  # type: ignore[attr-defined]
            x, y = xs[0][mine], ys[0][mine]
            train(x[:2], y[:2])
            r = train(x[2:], y[2:], poison=rank == 1)
            results[f"{name}_nan"] = (r.stepped, r.skipped)
            results[f"{name}_unchanged"] = all(
                torch.equal(a, p.detach().to_local())  # type: ignore[attr-defined]
                for a, p in zip(snap, model.parameters(), strict=True)
            )
            # A partial window then flush(): the pending gradients are reduced first.
            train(x[:2], y[:2])
            results[f"{name}_flush"] = step.flush().stepped  # type: ignore[union-attr]
        # FSDP2 with a fused optimizer: the sync-free path, DTensor gradients through
        # their local shards (no DTensor warning), a NaN on rank 1 skips both ranks.
        # Both ways to skip: on the host (what the CPU runs) and on the device (found_inf
        # and lazily read verdicts, what a GPU runs), forced here.
        for skip_on in ("host", "device"):
            waits = amp_stepper.host_read_waits
            if skip_on == "device":
                amp_stepper.host_read_waits = lambda device_type: True  # type: ignore[assignment]
            try:
                model = cp.parallelize(_net(), "fsdp")
                fused = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
                sf = autocast_step(fused, model=model, dtype=torch.bfloat16, accumulate=2,
                                   max_grad_norm=0.5)  # fmt: skip
            finally:
                amp_stepper.host_read_waits = waits  # type: ignore[assignment]
            x, y = xs[0][mine], ys[0][mine]
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)
                for i in range(6):
                    poison = rank == 1 and i == 3
                    sf(lambda p=poison, net=model, x=x, y=y: F.mse_loss(net(x).float(), y) * (
                        float("nan") if p else 1.0))()  # fmt: skip
            results[f"fused_{skip_on}"] = (sf.sync_free, sf._stepper.lazy, sf.steps,
                                           sf.skipped_steps)  # fmt: skip
        # The reduce-scatters of one plain micro-step (accumulate=1), for comparison.
        model = cp.parallelize(_net(), "fsdp")
        one = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                            dtype=torch.float32)  # fmt: skip
        before = calls[0]
        one(lambda: F.mse_loss(model(xs[0][mine]), ys[0][mine]))()
        results["rs_one_step"] = calls[0] - before

        # DDP, token-weighted, uneven tokens per rank and per micro-batch.
        g = torch.Generator().manual_seed(9)
        tokens = torch.randn(WORLD * 5, 4, generator=g)
        target = torch.randn(WORLD * 5, 1, generator=g)
        keep = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
        ddp = torch.nn.parallel.DistributedDataParallel(_net())
        wstep = autocast_step(torch.optim.SGD(ddp.parameters(), lr=0.1), model=ddp,
                              dtype=torch.float32, accumulate=2)  # fmt: skip

        @wstep
        def weighted(lo: int, hi: int) -> dict[str, torch.Tensor]:
            rows = slice(rank * 5 + lo, rank * 5 + hi)
            per = (ddp(tokens[rows]) - target[rows]).pow(2).squeeze(-1) * keep[rows]
            return {"loss": per.sum(), "weight": keep[rows].sum()}

        weighted(0, 1)
        assert weighted(1, 5).stepped
        results["ddp_weighted"] = {
            k: v.detach().clone() for k, v in ddp.module.state_dict().items()
        }

        # DDP: a checkpoint mid-window (each rank's gradients, accumulated under
        # no_sync, are its own) is refused; one taken after flush() resumes into a fresh
        # step, and after a full window the replicas stay identical.
        def fresh_ddp() -> tuple[Any, Any]:
            net = torch.nn.parallel.DistributedDataParallel(_net())
            st = autocast_step(torch.optim.SGD(net.parameters(), lr=0.1), model=net,
                               dtype=torch.float32, accumulate=4)  # fmt: skip
            return net, st

        xr = xs[1][mine]
        net, st = fresh_ddp()
        for _ in range(2):
            st(lambda n=net: n(xr).pow(2).mean())()
        try:
            st.state_dict()
        except RuntimeError as e:
            results["mid_window_refused"] = "under DDP" in str(e)
        st.flush()
        ckpt = {"step": st.state_dict(), "model": net.state_dict()}
        net2, st2 = fresh_ddp()
        net2.load_state_dict(ckpt["model"])
        st2.load_state_dict(ckpt["step"])
        for _ in range(4):
            st2(lambda n=net2: n(xr).pow(2).mean())()
        w = torch.cat([p.detach().reshape(-1) for p in net2.parameters()])
        gathered = [torch.empty_like(w) for _ in range(WORLD)]
        torch.distributed.all_gather(gathered, w)
        results["resume_flush_replicas_equal"] = torch.equal(gathered[0], gathered[1])
        torch.save(results, f"{out}/{rank}.pt")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def _weighted_reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    tokens = torch.randn(WORLD * 5, 4, generator=g)
    target = torch.randn(WORLD * 5, 1, generator=g)
    keep = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per = (model(tokens) - target).pow(2).squeeze(-1) * keep
    (per.sum() / keep.sum()).backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, tmp_path_factory.mktemp("amp_dist"), WORLD)


def test_fsdp2_fp32_matches_single_process_full_batch(ranks: list[dict[str, Any]]) -> None:
    ref = _reference()
    got = ranks[0]["float32_weights"]
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6)


def test_fsdp2_bf16_trains_close_to_reference(ranks: list[dict[str, Any]]) -> None:
    ref = _reference()
    for k, v in ref.items():
        torch.testing.assert_close(ranks[0]["bfloat16_weights"][k], v, rtol=0, atol=5e-2)


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_fsdp2_nan_on_one_rank_skips_every_rank(ranks: list[dict[str, Any]], name: str) -> None:
    for r in ranks:
        assert r[f"{name}_nan"] == (False, True)
        assert r[f"{name}_unchanged"]
        assert r[f"{name}_flush"]


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_fsdp2_accumulation_reduce_scatters_once_per_window(
    ranks: list[dict[str, Any]], name: str
) -> None:
    one = ranks[0]["rs_one_step"]
    print(f"reduce-scatters: one micro-step {one}, per accumulate=2 window "
          f"{ranks[0][f'{name}_rs_per_window']}")  # fmt: skip
    assert one > 0
    for r in ranks:
        assert r[f"{name}_rs_per_window"] == [one] * 3


def test_fsdp2_fused_optimizer_is_sync_free_and_skips_together(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        assert r["fused_host"] == (True, False, 2, 1)
        assert r["fused_device"] == (True, True, 2, 1)


def test_ddp_checkpoint_after_flush_resumes_with_equal_replicas(
    ranks: list[dict[str, Any]],
) -> None:
    assert all(r["mid_window_refused"] for r in ranks)
    assert all(r["resume_flush_replicas_equal"] for r in ranks)


def test_ddp_token_weighted_equals_full_batch_token_mean(ranks: list[dict[str, Any]]) -> None:
    ref = _weighted_reference()
    for r in ranks:
        for k, v in ref.items():
            torch.testing.assert_close(r["ddp_weighted"][k], v, rtol=0, atol=1e-6)
