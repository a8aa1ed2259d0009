"""The epoch's last micro-step of a partial window syncs through DDP's own backward.

Two gloo processes, DDP with a communication hook (``fp16_compress_hook``, a Python
hook that counts its calls, none), ``gradient_as_bucket_view`` off and on, windows of 3
over epochs of 5 micro-batches (a full window, then a partial one of 2). Inside
``step.last_micro_step()`` (entered by hand, by ``Checkpointer.batches()`` and by
``prefetch(loader, step=step)``) the partial window's last micro-step syncs, the hook
runs on it, ``flush()`` steps, and the weights equal a hand-written DDP loop's bit for
bit, in the decorated form and in the explicit one (``backward()`` inside the block, or
after it). Under FSDP2 the same micro-step reduce-scatters in its own backward, and the
weights equal a hand-written FSDP2 loop's. One launch runs every case; free port,
finite timeouts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from launcher_env import join_gloo, run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2
ACCUMULATE = 3
BATCHES = 5  # a window of 3, then a partial one of 2
EPOCHS = 2
FORMS = ("decorated", "block", "after_block", "batches", "prefetch")
HOOKS = ("fp16", "counting", "none")
FSDP_FORMS = ("decorated", "after_block", "batches")


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7 + rank)
    return [torch.randn(3, 4, generator=g) for _ in range(BATCHES)]


def _ddp(hook: str, bucket_view: bool, calls: list[int]) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    net = torch.nn.parallel.DistributedDataParallel(
        _net(), gradient_as_bucket_view=bucket_view, bucket_cap_mb=1e-4
    )

    # No annotations: DDP reads them (and postponed annotations are strings it refuses).
    def counting(state, bucket):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return default_hooks.allreduce_hook(None, bucket)

    if hook == "fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "counting":
        net.register_comm_hook(None, counting)
    return net


def _loss(net: Any, x: torch.Tensor) -> torch.Tensor:
    return net(x).pow(2).mean()


def _hand_written(hook: str, bucket_view: bool, xs: list[torch.Tensor]) -> tuple[Any, int]:
    """A plain DDP loop: no_sync but on a window's last micro-step (the epoch's too), the
    partial window's gradients scaled by accumulate / k, as ``flush()`` documents."""
    calls = [0]
    net = _ddp(hook, bucket_view, calls)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(EPOCHS):
        for i, x in enumerate(xs):
            closes = (i + 1) % ACCUMULATE == 0
            last = closes or i + 1 == len(xs)
            if i % ACCUMULATE == 0:
                opt.zero_grad(set_to_none=True)
            with contextlib.nullcontext() if last else net.no_sync():
                (_loss(net, x) / ACCUMULATE).backward()
            if last:
                if not closes:
                    grads = [p.grad for p in net.parameters() if p.grad is not None]
                    torch._foreach_mul_(grads, ACCUMULATE / (i % ACCUMULATE + 1))
                opt.step()
    return net, calls[0]


def _cudakit(
    form: str, hook: str, bucket_view: bool, xs: list[torch.Tensor], root: str
) -> tuple[Any, int, list[bool]]:
    import cudakit
    from cudakit.amp import autocast_step

    calls = [0]
    net = _ddp(hook, bucket_view, calls)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = autocast_step(opt, model=net, dtype=torch.float32, accumulate=ACCUMULATE)
    fn = step(lambda x: _loss(net, x))
    flushed: list[bool] = []

    def explicit(x: torch.Tensor, after: bool) -> None:
        with step:
            loss = _loss(net, x)
            if not after:
                step.backward(loss)
        if after:
            step.backward(loss)

    def by_hand(run: Callable[[torch.Tensor], Any]) -> None:
        for i, x in enumerate(xs):
            last = i + 1 == len(xs)
            if form == "after_block" and last:
                with step.last_micro_step(), step:
                    loss = _loss(net, x)
                step.backward(loss)  # outside both: the block's decision holds
                continue
            with step.last_micro_step() if last else contextlib.nullcontext():
                run(x)

    if form in ("batches", "prefetch"):
        loader: Any = xs if form == "batches" else cudakit.prefetch(xs, "cpu", step=step)
        ckpt = cudakit.Checkpointer(root, step=step, loader=loader, preemption=False)
        for _ in ckpt.epochs(EPOCHS):
            for x in ckpt.batches():
                fn(x)
            flushed.append(bool(fn.flush().stepped))
        ckpt.close()
        return net, calls[0], flushed
    for _ in range(EPOCHS):
        if form == "decorated":
            by_hand(fn)
        else:
            by_hand(lambda x: explicit(x, after=False))
        flushed.append(bool(step.flush().stepped))
    return net, calls[0], flushed


def _flat(net: Any) -> torch.Tensor:
    full = [getattr(p, "full_tensor", p.detach)() for p in net.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in full])


def _fsdp() -> Any:
    from torch.distributed.fsdp import fully_shard

    net = _net()
    fully_shard(net[0])
    fully_shard(net)
    return net


def _fsdp_hand_written(xs: list[torch.Tensor]) -> Any:
    """A plain FSDP2 loop: gradient sync off but on a window's (and the epoch's) last."""
    net = _fsdp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(EPOCHS):
        for i, x in enumerate(xs):
            closes = (i + 1) % ACCUMULATE == 0
            last = closes or i + 1 == len(xs)
            if i % ACCUMULATE == 0:
                opt.zero_grad(set_to_none=True)
            net.set_requires_gradient_sync(last)
            (_loss(net, x) / ACCUMULATE).backward()
            if last:
                if not closes:
                    grads = [p.grad.to_local() for p in net.parameters() if p.grad is not None]
                    torch._foreach_mul_(grads, ACCUMULATE / (i % ACCUMULATE + 1))
                opt.step()
    net.set_requires_gradient_sync(True)
    return net


def _fsdp_cudakit(form: str, xs: list[torch.Tensor], root: str) -> Any:
    import cudakit
    from cudakit.amp import autocast_step

    net = _fsdp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = autocast_step(opt, model=net, dtype=torch.float32, accumulate=ACCUMULATE)
    fn = step(lambda x: _loss(net, x))
    if form == "batches":
        ckpt = cudakit.Checkpointer(root, step=step, loader=xs, preemption=False)
        for _ in ckpt.epochs(EPOCHS):
            for x in ckpt.batches():
                fn(x)
            fn.flush()
        ckpt.close()
        return net
    for _ in range(EPOCHS):
        for i, x in enumerate(xs):
            last = i + 1 == len(xs)
            if form == "after_block":
                with step.last_micro_step() if last else contextlib.nullcontext(), step:
                    loss = _loss(net, x)
                step.backward(loss)
            else:
                with step.last_micro_step() if last else contextlib.nullcontext():
                    fn(x)
        step.flush()
    return net


def _worker(rank: int, port: int, out: str) -> None:
    join_gloo(rank, port, WORLD)
    results: dict[str, Any] = {}
    try:
        xs = _data(rank)
        for hook in HOOKS:
            for bucket_view in (False, True):
                ref, ref_calls = _hand_written(hook, bucket_view, xs)
                for form in FORMS:
                    key = f"{form}-{hook}-{bucket_view}"
                    net, calls, flushed = _cudakit(form, hook, bucket_view, xs, f"{out}/{key}")
                    results[f"{key}-equal"] = torch.equal(_flat(net), _flat(ref))
                    results[f"{key}-calls"] = (calls, ref_calls)
                    results[f"{key}-flushed"] = flushed
        ref = _fsdp_hand_written(xs)
        for form in FSDP_FORMS:
            net = _fsdp_cudakit(form, xs, f"{out}/fsdp-{form}")
            results[f"fsdp-{form}-equal"] = torch.equal(_flat(net), _flat(ref))
        torch.save(results, f"{out}/{rank}.pt")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, tmp_path_factory.mktemp("ddp_epoch_end"), WORLD, timeout=240)


@pytest.mark.parametrize("bucket_view", [False, True])
@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("form", FORMS)
def test_a_partial_window_steps_as_the_hand_written_loop(
    ranks: list[dict[str, Any]], form: str, hook: str, bucket_view: bool
) -> None:
    key = f"{form}-{hook}-{bucket_view}"
    for rank, r in enumerate(ranks):
        assert r[f"{key}-equal"], (rank, key)
        assert r[f"{key}-flushed"] == [True] * EPOCHS, (rank, key)
        calls, ref_calls = r[f"{key}-calls"]
        assert calls == ref_calls, (rank, key)  # the hook ran on the partial window too
        if hook == "counting":
            assert calls > 0


@pytest.mark.parametrize("form", FSDP_FORMS)
def test_under_fsdp2_a_partial_window_steps_as_the_hand_written_loop(
    ranks: list[dict[str, Any]], form: str
) -> None:
    for rank, r in enumerate(ranks):
        assert r[f"fsdp-{form}-equal"], (rank, form)
