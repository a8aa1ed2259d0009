"""recompute(): gradients bit for bit, keys unchanged, blocks found, FLOPs counted aside."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import cudakit.parallel as cp
from cudakit.parallel import Recompute, recompute, recomputed_blocks
from cudakit.speed import count_flops


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, depth: int = 4, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, scale=0.5)
        return self.head(h)


def _net(depth: int = 4) -> Net:
    torch.manual_seed(0)
    return Net(depth)


def _grads(model: nn.Module, seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout's RNG
    F.mse_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


SPECS = [
    Recompute("full"),
    Recompute("full", every=2),
    Recompute("selective"),
    Recompute("selective", every=3),
    Recompute("full", blocks=nn.Linear),
    Recompute("full", blocks=lambda name, m: name.endswith(".up")),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.policy}-{s.every}-{s.blocks}")
def test_gradients_bit_for_bit_with_dropout(spec: Recompute) -> None:
    want = _grads(_net())
    model = recompute(_net(), spec)
    assert recomputed_blocks(model)
    got = _grads(model)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


@given(
    policy=st.sampled_from(["full", "selective"]),
    every=st.integers(1, 5),
    depth=st.integers(1, 6),
)
def test_every_kth_block_and_exact_gradients(policy: str, every: int, depth: int) -> None:
    model = _net(depth)
    want = _grads(copy.deepcopy(model))
    recompute(model, policy, every=every)
    expected = [f"layers.{i}" for i in range(depth) if i % every == every - 1]
    assert recomputed_blocks(model) == expected
    got = _grads(model)
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_state_dict_keys_unchanged_and_load_either_way() -> None:
    plain = _net()
    keys = list(plain.state_dict())
    done = recompute(_net(), "full")
    assert list(done.state_dict()) == keys
    other = recompute(Net(), "selective")
    other.load_state_dict(plain.state_dict())  # saved without, loaded with
    fresh = Net()
    fresh.load_state_dict(done.state_dict())  # saved with, loaded without
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), plain.state_dict().values(), strict=True)
    )


def test_class_kept_for_isinstance_and_undo_with_none() -> None:
    model = recompute(_net(), "full")
    block = model.layers[0]
    assert isinstance(block, Block)
    assert type(block).__name__ == "RecomputedBlock"
    recompute(model, "none")
    assert type(block) is Block
    assert recomputed_blocks(model) == []


def test_second_call_replaces_the_first() -> None:
    model = recompute(_net(), "full")
    recompute(model, "selective", every=2)
    assert recomputed_blocks(model) == ["layers.1", "layers.3"]


def test_deepcopy_keeps_recompute() -> None:
    model = recompute(_net(), "full", every=2)
    twin = copy.deepcopy(model)
    assert recomputed_blocks(twin) == recomputed_blocks(model)


def test_recompute_counts_as_recomputed_flops_never_model_flops() -> None:
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    base = _net().eval()
    plain = count_flops(lambda x, y: F.mse_loss(base(x), y), x, y, model=base)
    model = recompute(_net(), "full").eval()
    again = count_flops(lambda x, y: F.mse_loss(model(x), y), x, y, model=model)
    assert plain.recomputed == 0
    assert again.total == plain.total  # the model FLOPs: MFU unchanged
    assert again.recomputed > 0
    assert again.hardware == again.total + again.recomputed


def test_selective_recomputes_less_than_full() -> None:
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    counts = {}
    for policy in ("full", "selective"):
        model = recompute(_net(), policy).eval()
        counts[policy] = count_flops(lambda x, y, m=model: F.mse_loss(m(x), y), x, y, model=model)
    assert counts["selective"].recomputed < counts["full"].recomputed


def test_budget_sets_the_compiler_budget_and_wraps_nothing() -> None:
    import torch._functorch.config as fc

    before = fc.activation_memory_budget
    try:
        model = recompute(_net(), "budget", budget=0.25)
        assert fc.activation_memory_budget == 0.25
        assert recomputed_blocks(model) == []
    finally:
        fc.activation_memory_budget = before


def test_compile_no_graph_break_and_same_gradients() -> None:
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend

    want = _grads(_net())
    model = recompute(_net(), "selective")
    counter = CompileCounterWithBackend("aot_eager")  # AOT's partitioner, inductor's path
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    _grads(compiled)
    got = _grads(compiled)
    assert counter.frame_count == 1  # one graph, no break, no recompile on the second call
    for name in want:
        assert torch.equal(got["_orig_mod." + name], want[name]), name


def test_parallelize_takes_recompute() -> None:
    model = cp.parallelize(_net(), device="cpu", recompute="full")
    assert recomputed_blocks(model) == [f"layers.{i}" for i in range(4)]
    model = cp.parallelize(_net(), device="cpu", recompute=Recompute("selective", every=2))
    assert recomputed_blocks(model) == ["layers.1", "layers.3"]


def _trained(policy: str | None, *, nan_at: int | None = None) -> tuple[Net, Any]:
    from cudakit.amp import autocast_step

    model = _net()
    if policy is not None:
        recompute(model, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    @autocast_step(
        opt, model=model, dtype="fp32", accumulate=2, max_grad_norm=1.0, locate_nonfinite=True
    )
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    g = torch.Generator().manual_seed(1)
    results = []
    for i in range(6):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        if i == nan_at:
            x[0, 0] = float("nan")
        torch.manual_seed(100 + i)
        results.append(step(x, y))
    return model, results


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_autocast_step_with_accumulation_and_clipping_bit_for_bit(policy: str) -> None:
    want, _ = _trained(None)
    got, _ = _trained(policy)
    for a, b in zip(want.state_dict().values(), got.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_the_guard_skips_and_locates_a_nan_with_recompute() -> None:
    from cudakit.amp.locate import NonFiniteWarning

    with pytest.warns(NonFiniteWarning) as want_warned:
        want, want_results = _trained(None, nan_at=2)
    with pytest.warns(NonFiniteWarning) as got_warned:
        got, got_results = _trained("full", nan_at=2)
    assert [str(w.message) for w in got_warned] == [str(w.message) for w in want_warned]
    for a, b in zip(want.state_dict().values(), got.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    skipped = [bool(r.skipped) for r in got_results]
    assert skipped == [bool(r.skipped) for r in want_results]
    assert any(skipped)
    where = [str(r.nonfinite) for r in got_results if r.skipped]
    assert where == [str(r.nonfinite) for r in want_results if r.skipped]


def test_checkpointer_saves_with_recompute_and_loads_without(tmp_path: Any) -> None:
    import cudakit

    saved = recompute(_net(), "full")
    opt = torch.optim.AdamW(saved.parameters())
    _grads(saved)
    opt.step()
    ckpt = cudakit.Checkpointer(tmp_path, model=saved, optimizer=opt, preemption=False)
    ckpt.save()
    ckpt.close()
    torch.manual_seed(1)
    plain = Net()
    opt2 = torch.optim.AdamW(plain.parameters())
    back = cudakit.Checkpointer(tmp_path, model=plain, optimizer=opt2, preemption=False)
    assert back.resume() is not None
    back.close()
    for a, b in zip(saved.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_class_made_on_top_by_a_wrapper_is_switched_not_nested() -> None:
    model = recompute(_net(), "full")
    for block in model.layers:  # as fully_shard does: a class of its own on top
        block.__class__ = type(f"FSDP{type(block).__name__}", (type(block),), {})
    wrapped = type(model.layers[0])
    recompute(model, "none")
    assert recomputed_blocks(model) == []
    assert type(model.layers[0]) is wrapped
    recompute(model, "selective")
    assert type(model.layers[0]) is wrapped  # no second subclass around the first
    assert recomputed_blocks(model) == [f"layers.{i}" for i in range(4)]
    want = _grads(_net())
    got = _grads(model)
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_a_recomputed_model_pickles_whole_and_comes_back_recomputed(tmp_path: Any) -> None:
    model = recompute(_net(), "selective", every=2)
    torch.save(model, tmp_path / "model.pt")
    back = torch.load(tmp_path / "model.pt", weights_only=False)
    assert recomputed_blocks(back) == ["layers.1", "layers.3"]
    assert type(back.layers[1]) is type(model.layers[1])
    assert type(back.layers[0]) is Block
    want, got = _grads(model), _grads(back)
    assert all(torch.equal(want[n], got[n]) for n in want)


class Averaged(nn.Module):
    """A block keeping a running mean the way hand-written code often does: by
    assigning a new tensor to the buffer, not writing into it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return torch.tanh(self.fc(x))


def _averaged_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.ModuleList([Averaged(), Averaged()]))


def _run_blocks(model: nn.Module, x: torch.Tensor) -> None:
    for block in model[0]:
        x = block(x)
    x.sum().backward()


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_a_buffer_the_forward_assigns_anew_moves_once_per_step(policy: str) -> None:
    plain, done = _averaged_net(), recompute(_averaged_net(), policy)
    for step in range(3):
        x = torch.randn(5, 4) + step
        _run_blocks(plain, x)
        _run_blocks(done, x)
    for (name, want), (_, got) in zip(plain.named_buffers(), done.named_buffers(), strict=True):
        assert torch.equal(want, got), name


def test_a_failed_buffer_copy_in_the_recompute_leaves_the_blocks_own_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = recompute(nn.Sequential(nn.ModuleList([nn.BatchNorm1d(3)])), "full")
    bn = model[0][0]
    own = dict(bn.named_buffers())
    y = bn(torch.randn(4, 3, requires_grad=True))
    clone = torch.Tensor.clone
    calls = []

    def out_of_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:  # the second buffer's copy
            raise torch.OutOfMemoryError("out of memory")
        return clone(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        y.sum().backward()
    monkeypatch.undo()
    assert len(calls) == 2
    assert all(buf is own[name] for name, buf in bn.named_buffers())


class Locked(nn.Module):
    """A block with an attribute pickle cannot take, left out by its __getstate__."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_recomputed_block_pickles_through_its_own_getstate(tmp_path: Any) -> None:
    model = recompute(nn.Sequential(nn.ModuleList([Locked()])), "full")
    torch.save(model, tmp_path / "model.pt")
    back = torch.load(tmp_path / "model.pt", weights_only=False)
    assert recomputed_blocks(back) == ["0.0"]
    assert isinstance(back[0][0].lock, type(threading.Lock()))


class CachingLayer(nn.Module):
    """A transformers decoder layer's shape (duck-typed): a class-level
    ``gradient_checkpointing`` and a KV cache that every forward appends to, taken
    positionally the way GPT2Model hands it to its blocks."""

    gradient_checkpointing = False

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(
        self, x: torch.Tensor, cache: list[torch.Tensor] | None = None, use_cache: bool = False
    ) -> torch.Tensor:
        y = self.fc(x)
        if cache is not None:
            cache.append(y.detach())
        return torch.tanh(y)


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("positional", [True, False])
def test_a_transformers_layer_gets_no_cache_in_training_however_it_is_passed(
    policy: str, positional: bool
) -> None:
    torch.manual_seed(0)
    model = recompute(nn.Sequential(nn.ModuleList([CachingLayer(), CachingLayer()])), policy)
    cache: list[torch.Tensor] = []
    x = torch.randn(3, 4)
    for layer in model[0]:
        x = layer(x, cache, use_cache=True) if positional else layer(x, cache=cache, use_cache=True)
    x.sum().backward()
    assert cache == []  # as under transformers' own checkpointing: nothing cached
    with torch.no_grad():  # no backward, no recompute: the cache is written
        model[0][0](x, cache) if positional else model[0][0](x, cache=cache)
    assert len(cache) == 1


class _Masked(nn.Module):
    """minGPT's block shape: a causal mask the forward only reads."""

    def __init__(self, width: int = 8, length: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("mask", torch.tril(torch.ones(length, length)))
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.mask.data_ptr())
        t = x.shape[1]
        att = (x @ x.transpose(1, 2)).masked_fill(self.mask[:t, :t] == 0, float("-inf"))
        return x + self.fc(att.softmax(-1) @ x)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_a_buffer_the_forward_only_reads_is_not_copied_for_the_recompute(policy: str) -> None:
    model = nn.Sequential(nn.ModuleList([_Masked(), _Masked()]))
    cp.recompute(model, policy)
    x = torch.randn(2, 5, 8, requires_grad=True)
    h = x
    for block in model[0]:
        h = block(h)
    h.sum().backward()
    for block in model[0]:
        assert len(block.seen) == 2  # the forward, then the recompute
        assert block.seen[0] == block.seen[1] == block.mask.data_ptr()
