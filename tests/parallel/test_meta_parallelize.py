"""parallelize() of a model built on the meta device: sharded before it exists.

Every launched process imports torch (seconds on a small machine), so each launch
builds several models and returns what the parent compares with one process's init.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from launcher_env import clean_launcher_env  # noqa: F401 (autouse fixture)
from meta_gpt import GPT, gpt_init
from torch import nn

import cudakit.parallel as cp
from cudakit.parallel import wrap
from cudakit.parallel.strategy import ParallelPlan

Config = tuple[int, int]  # (vocab, width)


def _meta_gpt(vocab: int, width: int) -> GPT:
    with torch.device("meta"):
        return GPT(vocab=vocab, width=width)


def _one_process(vocab: int, width: int) -> dict[str, torch.Tensor]:
    model = cp.materialize(_meta_gpt(vocab, width), "cpu", init=gpt_init, init_seed=7)
    return {**model.state_dict(), "rope.inv_freq": model.rope.inv_freq}


def _build(configs: list[Config], strategy: str) -> list[dict[str, Any]]:
    """Runs on every rank: each config built on meta, parallelized, gathered on rank 0."""
    out = []
    with cp.process_group(timeout=120):
        for vocab, width in configs:
            model = cp.parallelize(_meta_gpt(vocab, width), strategy, init=gpt_init, init_seed=7)
            inner = cp.unwrap(model)
            held = 0
            for p in inner.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                held += local.numel()
            full = {k: v.clone() for k, v in cp.state_dict(model).items()}
            out.append(
                {
                    "full": full,
                    "inv_freq": inner.rope.inv_freq.clone(),
                    "tied": inner.head.weight is inner.embed.weight,
                    "held": held,
                    "total": sum(p.numel() for p in _meta_gpt(vocab, width).parameters()),
                }
            )
    return out


def _check(results: list[list[dict[str, Any]]], configs: list[Config]) -> None:
    world = len(results)
    for i, config in enumerate(configs):
        ref = _one_process(*config)
        rank0 = results[0][i]
        assert set(rank0["full"]) == set(ref) - {"rope.inv_freq"}
        for key, value in rank0["full"].items():
            assert torch.equal(value, ref[key]), (world, config, key)
        for r, res in enumerate(results):
            assert res[i]["tied"], r
            assert torch.equal(res[i]["inv_freq"], ref["rope.inv_freq"]), r
        held = sum(res[i]["held"] for res in results)
        if world > 1:  # the shards add up to the model: nobody holds more than its own
            assert held == rank0["total"], (config, [res[i]["held"] for res in results])


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp_init_is_the_same_at_any_world_size(world: int) -> None:
    configs = [(37, 10), (5, 3), (2, 7)]  # rows that do not divide by 2 or 4; fewer than 4
    results = cp.launch(_build, configs, "fsdp", nprocs=world, timeout=300)
    _check(results, configs)


@pytest.mark.distributed
@settings(max_examples=2, deadline=None)
@given(
    configs=st.lists(
        st.tuples(st.integers(1, 13), st.integers(1, 9).map(lambda w: 2 * w)),
        min_size=1,
        max_size=3,
    )
)
def test_fsdp_init_over_widths_at_three_ranks(configs: list[Config]) -> None:
    results = cp.launch(_build, configs, "fsdp", nprocs=3, timeout=300)
    _check(results, configs)


def _counted_fsdp() -> dict[str, Any]:
    """One rank: the NaN fills, the scratch bytes and the values of a meta GPT's setup."""
    from cudakit.parallel import meta

    filled: list[tuple[int, ...]] = []
    scratch: list[int] = []
    poison, scratch_type = meta._poison, meta._Scratch

    class Scratch(scratch_type):  # type: ignore[misc, valid-type]
        def __init__(self, steps: Any) -> None:
            super().__init__(steps)
            scratch.append(self.size)

    def counted(t: torch.Tensor) -> None:
        filled.append(tuple(t.shape))
        poison(t)

    meta._poison = counted  # this rank's process only: it ends with the launch
    meta._Scratch = Scratch  # type: ignore[misc]
    with cp.process_group(timeout=120):
        model = cp.parallelize(_meta_gpt(37, 10), "fsdp", init=gpt_init, init_seed=7)
        full = {k: v.clone() for k, v in cp.state_dict(model).items()}
    return {"filled": filled, "scratch": scratch, "full": full}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_init_writes_whole_tensors_without_a_nan_fill(world: int) -> None:
    results = cp.launch(_counted_fsdp, nprocs=world, timeout=300)
    ref = _one_process(37, 10)
    tied = 37 * 10 * 4  # the head's copy of the tied embedding, written then dropped
    for res in results:
        assert res["filled"] == []
        if world == 1:  # each shard is its whole tensor: written in place
            assert res["scratch"] == [-(-tied // 64) * 64]
        else:  # a full copy of the largest module's tensors
            assert res["scratch"][0] > tied
    for key, value in results[0]["full"].items():
        assert torch.equal(value, ref[key]), key


@pytest.mark.distributed
def test_ddp_takes_a_meta_model() -> None:
    configs = [(11, 6)]
    results = cp.launch(_build, configs, "ddp", nprocs=2, timeout=300)
    ref = _one_process(*configs[0])
    for res in results:
        for key, value in res[0]["full"].items():
            assert torch.equal(value, ref[key]), key
        assert res[0]["tied"]


def test_one_process_takes_a_meta_model() -> None:
    model = cp.parallelize(_meta_gpt(9, 4), "none", device="cpu", init=gpt_init, init_seed=7)
    ref = _one_process(9, 4)
    for key, value in model.state_dict().items():
        assert torch.equal(value, ref[key]), key
    assert model.head.weight is model.embed.weight


def test_parallelize_allocates_and_initialises_a_meta_model() -> None:
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    same = cp.parallelize(net, device="meta")  # meta to meta: nothing to copy
    assert same is net
    assert all(p.is_meta for p in net.parameters())
    out = cp.parallelize(net, device="cpu")
    assert out is net
    assert not any(t.is_meta for t in [*net.parameters(), *net.buffers()])
    assert torch.equal(net[1].running_var, torch.ones(2))


def test_init_for_a_model_not_on_meta_is_refused() -> None:
    net = nn.Linear(2, 2)
    before = net.weight.clone()
    with pytest.raises(ValueError, match=r"parallelize\(init=\.\.\.\).*is allocated already"):
        cp.parallelize(net, "none", device="cpu", init=gpt_init)
    assert torch.equal(net.weight, before)
    with pytest.raises(ValueError, match=r"stays on the meta device"):
        cp.parallelize(_meta_gpt(3, 2), "none", device="meta", init=gpt_init)


def test_untouched_tensors_refuse_the_call_before_anything() -> None:
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(2, 2))
        net.register_parameter("scale", nn.Parameter(torch.ones(2)))
    with pytest.raises(ValueError, match=r"parallelize\(\): no reset_parameters.*'scale"):
        cp.parallelize(net, "none", device="cpu")
    assert all(p.is_meta for p in net.parameters())


def test_a_partly_meta_model_is_refused() -> None:
    net = nn.Sequential(nn.Linear(2, 2))
    with torch.device("meta"):
        net.append(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"parallelize\(\) got a Sequential only partly on"):
        cp.parallelize(net, "none", device="cpu")
    assert not net[0].weight.is_meta
    assert net[1].weight.is_meta


def test_init_arguments_are_checked_at_the_door() -> None:
    with pytest.raises(TypeError, match=r"parallelize\(init=\.\.\.\) expects a callable"):
        cp.parallelize(_meta_gpt(3, 2), "none", device="cpu", init=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"parallelize\(init_seed=\.\.\.\) expects an int >= 0"):
        cp.parallelize(_meta_gpt(3, 2), "none", device="cpu", init_seed=-2)


def test_a_meta_model_under_data_parallel_is_refused() -> None:
    plan = ParallelPlan("dp", "dp", torch.device("cuda", 0), False, None, (0, 1), {}, {})
    model = _meta_gpt(3, 2)
    build = wrap.plan_build("parallelize", model, None, 0, plan.device)
    with pytest.raises(ValueError, match=r"DataParallel copies the whole model.*materialize"):
        wrap._check_plan(model, plan, build)


def test_cpu_offload_keeps_the_parameters_on_the_cpu() -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from cudakit.parallel.meta import params_device

    gpu = torch.device("cuda", 0)
    assert params_device({"offload_policy": CPUOffloadPolicy()}, gpu) == torch.device("cpu")
    assert params_device({"offload_policy": OffloadPolicy()}, gpu) == gpu
    assert params_device({}, gpu) == gpu


def _offloaded() -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy

    with cp.process_group(timeout=120):
        model = cp.parallelize(
            _meta_gpt(11, 6), "fsdp", init=gpt_init, init_seed=7, offload_policy=CPUOffloadPolicy()
        )
        devices = {p.to_local().device.type for p in model.parameters()}
        buffer = model.rope.inv_freq.device.type
        model(torch.arange(6, device="cuda").reshape(2, 3)).sum().backward()
        full = {k: v.clone() for k, v in cp.state_dict(model).items()}
        return {"devices": devices, "buffer": buffer, "full": full}


@pytest.mark.cuda
@pytest.mark.distributed
def test_cpu_offload_on_a_gpu() -> None:
    (res,) = cp.launch(_offloaded, nprocs=1, timeout=300)
    assert res["devices"] == {"cpu"}
    assert res["buffer"] == "cuda"
    ref = _one_process(11, 6)  # initialised on the CPU, where the shards live
    for key, value in res["full"].items():
        assert torch.equal(value, ref[key]), key


def test_a_meta_built_model_composes_with_autocast_step_and_warmup() -> None:
    import cudakit

    model = cp.parallelize(_meta_gpt(13, 6), "none", device="cpu", init=gpt_init)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cudakit.autocast_step(opt, model=model, dtype=torch.float32)
    before = model.embed.weight.clone()
    with step:
        loss = model(torch.arange(6).reshape(2, 3)).logsumexp(-1).mean()
    assert step.backward(loss).stepped
    assert not torch.equal(model.embed.weight, before)
    assert model.head.weight is model.embed.weight  # still tied after a step
    report = cudakit.warmup(
        model,
        torch.arange(6).reshape(2, 3),
        loss_fn=lambda m, b: m(b).logsumexp(-1).mean(),
        device="cpu",
    )
    assert report is not None
