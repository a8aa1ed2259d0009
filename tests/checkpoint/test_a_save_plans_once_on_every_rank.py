"""Under 2 gloo ranks (DDP, FSDP2), a save plans once while the state keeps its
structure, plans again when it changes on every rank, and its files are those DCP's
own save of the same state writes: the same ``.metadata``, loaded by ``dcp.load``
bit for bit. One spawn serves both strategies; free port, finite timeouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launcher_env import join_gloo, run_ranks

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

WORLD = 2


def _objects(strategy: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import cudakit.parallel as cp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = cp.parallelize(net, strategy, device="cpu")
    opt = torch.optim.AdamW(list(model.parameters())[:2], lr=1e-2)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(7))
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _new_group(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.add_param_group({"params": list(model.parameters())[2:], "lr": 0.5})


def _local(tree: Any) -> Any:
    """A state dict with each DTensor as this rank's shard."""
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_local(v) for v in tree]
    return tree.to_local() if hasattr(tree, "to_local") else tree


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from cudakit.parallel import unwrap

    msd, osd = get_state_dict(unwrap(model), opt)
    return {"model": {"model": msd}, "optim": {"model": osd}}


def _scenario(strategy: str, root: Path) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

    import cudakit

    model, opt = _objects(strategy)
    _step(model, opt)
    ckpt = cudakit.Checkpointer(root / strategy, model=model, optimizer=opt, preemption=False)
    plans = ckpt._writer._plans

    def save_next() -> Path:
        pos = ckpt.position
        ckpt._position = cudakit.Position(0, 0, pos.total + 1, pos.windows + 1)
        path = ckpt.save()
        assert path is not None
        return path

    out: dict[str, Any] = {}
    for _ in range(3):
        _step(model, opt)
        save_next()
    out["unchanged"] = (plans.made, plans.reused)
    _new_group(model, opt)
    _step(model, opt)
    path = save_next()
    out["changed"] = (plans.made, plans.reused)
    ckpt.close()
    dist.barrier()

    theirs = root / f"{strategy}-dcp"
    dcp.save(_state(model, opt), storage_writer=FileSystemWriter(str(theirs)))
    dist.barrier()
    mine_md = FileSystemReader(str(path)).read_metadata()
    theirs_md = FileSystemReader(str(theirs)).read_metadata()
    out["same_metadata"] = mine_md.state_dict_metadata == theirs_md.state_dict_metadata
    out["same_places"] = {
        k: (v.relative_path, v.length) for k, v in mine_md.storage_data.items()
    } == {k: (v.relative_path, v.length) for k, v in theirs_md.storage_data.items()}

    fresh, fresh_opt = _objects(strategy)
    _new_group(fresh, fresh_opt)
    _step(fresh, fresh_opt)
    target = _state(fresh, fresh_opt)
    dcp.load(target, storage_reader=FileSystemReader(str(path)))
    out["loads_bit_for_bit"] = _equal(_local(target), _local(_state(model, opt)))
    return out


def _worker(rank: int, port: int, out: str) -> None:
    join_gloo(rank, port, WORLD)
    results: dict[str, Any] = {}
    try:
        for strategy in ("ddp", "fsdp"):
            results[strategy] = _scenario(strategy, Path(out))
    finally:
        torch.save(results, Path(out) / f"{rank}.pt")
        torch.distributed.destroy_process_group()


def test_every_rank_follows_one_kept_plan_and_plans_again_on_a_change(tmp_path: Path) -> None:
    results = run_ranks(_worker, tmp_path, WORLD, timeout=240)
    for rank, by_strategy in enumerate(results):
        assert set(by_strategy) == {"ddp", "fsdp"}, f"rank {rank} did not finish: {by_strategy}"
        for strategy, found in by_strategy.items():
            where = f"rank {rank}, {strategy}"
            if rank == 0:  # the coordinator makes the global plan
                assert found["unchanged"] == (1, 2), where
                assert found["changed"] == (2, 2), where
            else:
                assert found["unchanged"] == found["changed"] == (0, 0), where
            assert found["same_metadata"], where
            assert found["same_places"], where
            assert found["loads_bit_for_bit"], where
