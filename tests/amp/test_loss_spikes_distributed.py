"""Loss spikes across two gloo processes (DDP): every rank decides together.

A spike injected on one rank only, at one window, raises the loss both ranks watch (the
window loss averaged over ranks, carried by the non-finite guard's one all-reduce), so
both skip that window and no other; the replicas, the running statistics and the
counters stay identical. Both ways a sync-free step skips (host, device) in one launch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from launcher_env import join_gloo, run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2
WINDOWS = 10
SPIKE_AT = 7  # the window whose loss rank 0 multiplies by 40


def _worker(rank: int, port: int, out: str) -> None:
    import cudakit.amp._stepper as amp_stepper
    from cudakit.amp import SpikeRule, autocast_step

    join_gloo(rank, port, WORLD)
    results: dict[str, Any] = {}
    calls = [0]
    real = torch.distributed.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    torch.distributed.all_reduce = counting  # type: ignore[assignment]
    try:
        g = torch.Generator().manual_seed(3 + rank)  # each rank its own data
        data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
                for _ in range(WINDOWS * 2)]  # fmt: skip
        rule = SpikeRule(on=("loss", "grad_norm"), z=4.0, warmup=3)
        for skip_on in ("host", "device", "off"):
            waits = amp_stepper.host_read_waits
            if skip_on == "device":
                amp_stepper.host_read_waits = lambda device_type: True  # type: ignore[assignment]
            try:
                torch.manual_seed(0)
                net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                          torch.nn.Linear(8, 1))  # fmt: skip
                ddp = torch.nn.parallel.DistributedDataParallel(net)
                opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, fused=True)
                step = autocast_step(opt, model=ddp, dtype=torch.float32, accumulate=2,
                                     skip_spikes=rule if skip_on != "off" else False)  # fmt: skip
            finally:
                amp_stepper.host_read_waits = waits  # type: ignore[assignment]

            @step
            def train(x: torch.Tensor, y: torch.Tensor, k: float, net: Any = ddp) -> torch.Tensor:
                return F.mse_loss(net(x), y) * k

            flags = []
            calls[0] = 0
            for i, (x, y) in enumerate(data):
                k = 40.0 if rank == 0 and i // 2 == SPIKE_AT else 1.0
                r = train(x, y, k)
                if i % 2 == 1:
                    flags.append((bool(r.skipped), bool(r.spike)))
            collectives = calls[0]
            w = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
            gathered = [torch.empty_like(w) for _ in range(WORLD)]
            torch.distributed.all_gather(gathered, w)
            results[skip_on] = {
                "flags": flags,
                "replicas_equal": torch.equal(gathered[0], gathered[1]),
                "counts": (step.steps, step.skipped_steps, step.spike_steps),
                "stats": step.state_dict()["spike_stats"],
                "lazy": step._stepper.lazy,
                "all_reduces": collectives,
            }
        torch.save(results, f"{out}/{rank}.pt")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, tmp_path_factory.mktemp("spikes_dist"), WORLD)


@pytest.mark.parametrize("skip_on", ["host", "device"])
def test_a_spike_on_one_rank_is_skipped_by_both(ranks: list[dict[str, Any]], skip_on: str) -> None:
    want = [(i == SPIKE_AT, i == SPIKE_AT) for i in range(WINDOWS)]
    for rank, got in enumerate(ranks):
        run = got[skip_on]
        assert run["lazy"] == (skip_on == "device"), rank
        assert run["flags"] == want, f"rank {rank}"
        assert run["replicas_equal"], f"rank {rank}"
        assert run["counts"] == (WINDOWS - 1, 1, 1), f"rank {rank}"
    assert ranks[0][skip_on]["stats"] == ranks[1][skip_on]["stats"]
    assert ranks[0][skip_on]["stats"]["loss"]["count"] == WINDOWS - 1


def test_both_paths_agree(ranks: list[dict[str, Any]]) -> None:
    for got in ranks:
        assert got["host"]["stats"] == got["device"]["stats"]


def test_the_loss_rides_on_the_guards_one_all_reduce(ranks: list[dict[str, Any]]) -> None:
    """One all-reduce per window (the guard's), with spike skipping or without."""
    for got in ranks:
        assert got["off"]["all_reduces"] == WINDOWS
        assert got["host"]["all_reduces"] == got["device"]["all_reduces"] == WINDOWS
