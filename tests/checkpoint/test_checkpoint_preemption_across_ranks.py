"""A stop signal under several ranks saves at the first window boundary after it.

Two gloo processes, DDP and FSDP2, ``accumulate=2`` and ``every=3`` (saves at batches
6 and 12): a SIGTERM that every rank has before a boundary (torchrun passes it to
every rank) saves there on every rank, not a window later; one that some rank has
only after that boundary, or never, saves at the next boundary. Each scenario runs in
the same two processes one after the other (the stop's ``SystemExit`` is caught), so
one spawn serves them all. Free port, finite timeouts.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from launcher_env import join_gloo, run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2

#: Scenario: the batch (1-based, in hand, before its step) at which each rank gets a
#: SIGTERM, and the checkpoint the stop must save.
SCENARIOS: dict[str, tuple[dict[int, int], int]] = {
    "both_before_10": ({0: 9, 1: 9}, 10),
    "both_at_the_boundary_batch": ({0: 10, 1: 10}, 10),
    "both_before_10_one_earlier": ({0: 7, 1: 9}, 10),
    "one_before_10_other_after": ({0: 9, 1: 11}, 12),
    "one_before_10": ({1: 9}, 12),
    "one_at_the_boundary_batch": ({0: 10}, 12),
}


def _run(strategy: str, root: Path, signal_at: dict[int, int]) -> dict[str, Any]:
    import cudakit
    import cudakit.parallel as cp
    from cudakit.checkpoint._layout import read_manifest

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model = cp.parallelize(net, strategy, device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cudakit.autocast_step(opt, model=model, dtype=torch.float32, accumulate=2)
    train_step = step(lambda x, y: F.mse_loss(model(x), y))
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
    )
    loader = cp.distributed_loader(data, batch_size=2, shuffle=False)  # 16 batches a rank
    ckpt = cudakit.Checkpointer(root, step=step, loader=loader, every=3)
    rank = cp.rank()
    code = None
    try:
        for _ in ckpt.epochs(1):
            for x, y in ckpt.batches():
                if signal_at.get(rank) == ckpt.position.total:
                    signal.raise_signal(signal.SIGTERM)
                train_step(x, y)
    except SystemExit as exc:
        code = exc.code
    finally:
        ckpt.close()
    torch.distributed.barrier()  # rank 0 may still be renaming the checkpoint into place
    latest = cudakit.find_latest(root)
    # (the batch count the checkpoint was taken at: its name says the step)
    total = read_manifest(latest).total if latest is not None else None
    return {"code": code, "total": total}


def _worker(rank: int, port: int, out: str) -> None:
    join_gloo(rank, port, WORLD)
    results: dict[str, Any] = {}
    try:
        for strategy in ("ddp", "fsdp"):
            for name, (at, _) in SCENARIOS.items():
                got = _run(strategy, Path(out) / f"{strategy}-{name}", at)
                results[f"{strategy}-{name}"] = got
        torch.save(results, f"{out}/{rank}.pt")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, tmp_path_factory.mktemp("stop_ranks"), WORLD, timeout=240)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_rank_saves_at_the_boundary_after_the_signal(
    ranks: list[dict[str, Any]], strategy: str, name: str
) -> None:
    _, expected = SCENARIOS[name]
    for rank, r in enumerate(ranks):
        got = r[f"{strategy}-{name}"]
        assert got["code"] == 128 + signal.SIGTERM, (rank, got)
        assert got["total"] == expected, (rank, got)


def test_the_benchmark_of_the_agreement_prints_its_cost_per_window(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``bench_checkpoint.py --stop --quick``: both loops side by side, the ratios."""
    import importlib
    import sys

    bench = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    module = importlib.import_module("bench_checkpoint")
    threads = torch.get_num_threads()
    try:
        module.main(["--stop", "--quick", "--rounds", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "on / off" in out
    assert re.search(r"the stop agreement costs at most [\d.]+% of a window", out), out
