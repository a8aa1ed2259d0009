"""A model built on the meta device trains like one built the usual way.

After ``parallelize(meta_model, init=...)`` the model is an ordinary (or FSDP2)
module: ``autocast_step`` (with ``compile=True``), ``warmup``, ``find_batch_size``
and FSDP2's CPU offload take it as they take a model built on the device, and
give the same numbers bit for bit.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from meta_gpt import GPT, gpt_init

import cudakit
import cudakit.parallel as cp


def _meta_gpt(vocab: int = 13, width: int = 6) -> GPT:
    with torch.device("meta"):
        return GPT(vocab=vocab, width=width)


def _built_the_usual_way(like: torch.nn.Module, vocab: int = 13, width: int = 6) -> GPT:
    """The same GPT built on the CPU, given ``like``'s weights: the reference."""
    model = GPT(vocab=vocab, width=width)
    model.load_state_dict(like.state_dict())
    return model


def _batches(n: int, vocab: int = 13) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (4, 5), generator=gen) for _ in range(n)]


def _train(
    model: torch.nn.Module, opt: torch.optim.Optimizer | None = None, *, compile: bool = False
) -> list[torch.Tensor]:
    """Three AdamW steps of ``autocast_step`` in fp32: the losses."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)

    @cudakit.autocast_step(opt, model=model, dtype=torch.float32, compile=compile)
    def step(idx: torch.Tensor) -> torch.Tensor:
        logits = model(idx)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())

    return [step(idx).loss.detach() for idx in _batches(3)]


def _warm_up(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    cudakit.warmup(
        model,
        _batches(1)[0],
        loss_fn=lambda m, b: m(b).logsumexp(-1).mean(),
        optimizer=opt,
        device="cpu",
    )


def test_compile_trains_a_meta_built_model_as_it_trains_one_built_on_the_cpu() -> None:
    meta = cp.parallelize(_meta_gpt(), "none", device="cpu", init=gpt_init, init_seed=5)
    usual = _built_the_usual_way(meta)
    torch._dynamo.reset()
    got = _train(meta, compile=True)
    torch._dynamo.reset()
    want = _train(usual, compile=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for (name, a), b in zip(meta.state_dict().items(), usual.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert meta.head.weight is meta.embed.weight  # tied through compile and the steps


def test_warmup_and_find_batch_size_leave_a_meta_built_model_as_it_was() -> None:
    model = cp.parallelize(_meta_gpt(), "none", device="cpu", init=gpt_init, init_seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = copy.deepcopy(model.state_dict())
    _warm_up(model, opt)

    def trial(batch_size: int) -> int:
        idx = torch.zeros(batch_size, 5, dtype=torch.long)
        model(idx).logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        return batch_size

    found = cudakit.find_batch_size(trial, start=2, upper=8)
    assert found == 8
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not opt.state  # warm-up steps left no optimizer state behind
    assert model.head.weight is model.embed.weight


def _fsdp_composes(offload: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy

    policy = CPUOffloadPolicy(pin_memory=False)  # (pinning needs a GPU)
    kwargs: dict[str, Any] = {"offload_policy": policy} if offload else {}
    with cp.process_group(timeout=120):
        model = cp.parallelize(_meta_gpt(), "fsdp", init=gpt_init, init_seed=5, **kwargs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        initial = {k: v.clone() for k, v in cp.state_dict(model).items()}
        _warm_up(model, opt)
        after_warmup = {k: v.clone() for k, v in cp.state_dict(model).items()}
        losses = _train(model, opt)
        trained = {k: v.clone() for k, v in cp.state_dict(model).items()}
        return {
            "initial": initial,
            "after_warmup": after_warmup,
            "losses": losses,
            "trained": trained,
        }


@pytest.mark.distributed
@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "cpu-offload"])
def test_a_sharded_meta_model_warms_up_and_trains_like_one_process(offload: bool) -> None:
    ranks = cp.launch(_fsdp_composes, offload, nprocs=2, timeout=240)
    reference = cp.materialize(_meta_gpt(), "cpu", init=gpt_init, init_seed=5)
    res = ranks[0]  # (cp.state_dict gathers the full tensors on rank 0)
    for key, value in reference.state_dict().items():
        assert torch.equal(res["initial"][key], value), key
        assert torch.equal(res["after_warmup"][key], value), key
    # Every rank trains on the same batches: the same loss as one process would see.
    usual = _built_the_usual_way(reference)
    want = _train(usual)
    for rank in ranks:
        for a, b in zip(rank["losses"], want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for key, value in usual.state_dict().items():
        torch.testing.assert_close(res["trained"][key], value, rtol=1e-5, atol=1e-6)
