"""What torch's checkpoint tests assert, asked of ``cudakit.parallel.recompute``.

Ported from pytorch test/test_utils.py (TestCheckpoint: outputs and gradients, the CPU
RNG, inputs without grad, non-tensor and keyword arguments, tuple and dict outputs,
``no_grad``, ``retain_graph``, double backward), test/test_autograd.py's
non-reentrant checkpoint tests (saved tensors, hooks, buffers), and
test/distributed/_composable/test_checkpoint.py (tensor-only, random and
multi-argument modules, here under FSDP2 on two gloo ranks), and from torchtitan's
selective activation checkpointing (torchtitan/distributed/activation_checkpoint.py:
matmul outputs kept, the rest recomputed). Every comparison is bit for bit in fp32.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from port_torch_checkpoint import WIDTH, chain, fsdp_steps
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import cudakit.parallel as cp
from cudakit.parallel import recompute, recomputed_blocks

POLICIES = ["full", "selective"]


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(x))))


class Stack(nn.Module):
    def __init__(self, depth: int = 3, width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _pair(make: Callable[[], nn.Module], policy: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = make()
    return plain, recompute(copy.deepcopy(plain), policy)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _run(model: nn.Module, x: torch.Tensor, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward from a fixed CPU RNG state; the output and the RNG after."""
    torch.manual_seed(seed)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), torch.get_rng_state()


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("policy", POLICIES)
def test_outputs_input_and_parameter_gradients_equal_bit_for_bit(policy: str) -> None:
    plain, done = _pair(Stack, policy)
    assert recomputed_blocks(done) == ["layers.0", "layers.1", "layers.2"]
    x1 = torch.randn(5, 16, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    out1, _ = _run(plain, x1)
    out2, _ = _run(done, x2)
    assert torch.equal(out1, out2)
    assert torch.equal(x1.grad, x2.grad)
    _assert_same(_grads(plain), _grads(done))


@pytest.mark.parametrize("policy", POLICIES)
def test_random_draws_are_replayed_and_the_cpu_rng_ends_where_it_would(policy: str) -> None:
    # test_checkpoint_rng_cpu / test_random_cpu: randn and dropout inside the block.
    plain, done = _pair(chain, policy)
    x = torch.randn(4, WIDTH)
    out1, rng1 = _run(plain, x)
    out2, rng2 = _run(done, x)
    assert torch.equal(out1, out2)
    assert torch.equal(rng1, rng2)  # the recompute restored the state it borrowed
    _assert_same(_grads(plain), _grads(done))


@pytest.mark.parametrize("policy", POLICIES)
def test_an_input_without_grad_still_gives_parameter_gradients(policy: str) -> None:
    # test_checkpoint_no_grad_inputs: non-reentrant checkpoint needs no input with grad.
    plain, done = _pair(Stack, policy)
    x = torch.randn(3, 16)
    _run(plain, x)
    _run(done, x)
    assert not x.requires_grad
    assert x.grad is None
    _assert_same(_grads(plain), _grads(done))
    assert len(_grads(done)) == len(list(done.parameters()))


class Scaled(nn.Module):
    """A block with positional non-tensor arguments and keywords, tensors among them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.seen: list[dict[str, Any]] = []

    def forward(
        self,
        x: torch.Tensor,
        scale: float,
        tag: str,
        *,
        bias: torch.Tensor | None = None,
        flags: dict[str, bool] | None = None,
        **extra: Any,
    ) -> torch.Tensor:
        self.seen.append({"scale": scale, "tag": tag, "flags": flags, **extra})
        y = self.fc(x) * scale
        if bias is not None:
            y = y + bias
        return torch.tanh(y) if (flags or {}).get("tanh") else y


class ScaledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Scaled(), Scaled()])

    def forward(self, x: torch.Tensor, bias: torch.Tensor, **extra: Any) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, 0.5 + i, f"layer{i}", bias=bias, flags={"tanh": i == 0}, **extra)
        return x


def test_non_tensor_and_keyword_arguments_reach_the_block() -> None:
    # test_checkpoint_non_tensor / test_checkpoint_kwargs: a tensor keyword gets its grad.
    plain, done = _pair(ScaledNet, "full")
    x = torch.randn(2, 8)
    b1, b2 = torch.randn(8, requires_grad=True), torch.randn(8)
    b2 = b1.detach().clone().requires_grad_()
    plain(x, b1).sum().backward()
    done(x, b2).sum().backward()
    assert torch.equal(b1.grad, b2.grad)
    _assert_same(_grads(plain), _grads(done))
    first = done.layers[0].seen
    assert first[0] == {"scale": 0.5, "tag": "layer0", "flags": {"tanh": True}}
    assert len(first) == 2  # the forward, then the recompute with the same arguments
    assert first[0] == first[1]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    "name", ["debug", "preserve_rng_state", "early_stop", "determinism_check", "use_reentrant"]
)
def test_keywords_named_like_checkpoint_options_belong_to_the_block(policy: str, name: str) -> None:
    # torch.utils.checkpoint takes these keywords itself; a block's own must reach it.
    plain, done = _pair(ScaledNet, policy)
    x, bias = torch.randn(2, 8), torch.zeros(8)
    value = "the block's"
    plain(x, bias, **{name: value}).sum().backward()
    done(x, bias, **{name: value}).sum().backward()
    assert all(seen[name] == value for seen in done.layers[0].seen)
    _assert_same(_grads(plain), _grads(done))


class Fork(nn.Module):
    """Returns a dict holding a tuple, a tensor that needs no grad and a plain value."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.a(x)
        return {"pair": (h.relu(), self.b(h).sin()), "mask": x > 0, "n": int(x.shape[0])}


class ForkNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Fork()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers[0](x)
        left, right = out["pair"]
        return (left * right).masked_fill(out["mask"], 0.0).sum() / out["n"]


@pytest.mark.parametrize("policy", POLICIES)
def test_tuple_and_dict_outputs_with_non_tensors(policy: str) -> None:
    # test_checkpoint_non_tensor_inputs_outputs / test_multi_args.
    plain, done = _pair(ForkNet, policy)
    x = torch.randn(4, 6)
    out1, _ = _run(plain, x)
    out2, _ = _run(done, x)
    assert torch.equal(out1, out2)
    _assert_same(_grads(plain), _grads(done))


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.fc(x)))


class NormedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Normed(), Normed()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("policy", POLICIES)
def test_batchnorm_running_statistics_move_once_per_step(policy: str) -> None:
    # A buffer the forward writes must be written once, as without recompute: the
    # recompute runs the forward again, and must not count the batch twice.
    plain, done = _pair(NormedNet, policy)
    for step in range(2):
        x = torch.randn(8, 6) + step
        _run(plain, x)
        _run(done, x)
    want, got = plain.state_dict(), done.state_dict()
    assert int(got["layers.0.bn.num_batches_tracked"]) == 2
    for key in want:
        assert torch.equal(want[key], got[key]), key
    _assert_same(_grads(plain), _grads(done))


def test_batchnorm_running_statistics_move_once_under_compile() -> None:
    torch._dynamo.reset()
    plain, done = _pair(NormedNet, "selective")
    compiled = torch.compile(done, backend="aot_eager", fullgraph=True)
    x = torch.randn(8, 6)
    _run(plain, x)
    _run(compiled, x)
    for key, value in plain.state_dict().items():
        assert torch.equal(done.state_dict()[key], value), key


class Outer(nn.Module):
    """A block holding blocks of the same kind: only the outermost one recomputes."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(Block(8), nn.Sequential(Block(8), nn.Tanh()))
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.inner(x))


class Nest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Outer(), Outer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_nested_modules_recompute_at_the_outermost_block() -> None:
    torch.manual_seed(0)
    plain = Nest()
    done = recompute(copy.deepcopy(plain), "full", blocks=(Outer, Block))
    assert recomputed_blocks(done) == ["layers.0", "layers.1"]
    x = torch.randn(3, 8)
    out1, _ = _run(plain, x)
    out2, _ = _run(done, x)
    assert torch.equal(out1, out2)
    _assert_same(_grads(plain), _grads(done))


# --------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("policy", POLICIES)
def test_a_forward_under_no_grad_or_inference_mode_just_runs(policy: str) -> None:
    # test_checkpoint_valid's counterpart for non-reentrant: no graph, no error.
    plain, done = _pair(Stack, policy)
    plain.eval()
    done.eval()
    x = torch.randn(3, 16, requires_grad=True)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            out = done(x)
            assert out.grad_fn is None
            assert not out.requires_grad
            assert torch.equal(out, plain(x))


def test_retain_graph_backward_twice_adds_up_as_without_recompute() -> None:
    plain, done = _pair(Stack, "full")
    x = torch.randn(3, 16)
    for model in (plain, done):
        torch.manual_seed(5)
        loss = model(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
    _assert_same(_grads(plain), _grads(done))


@pytest.mark.parametrize("policy", POLICIES)
def test_a_second_backward_without_retain_graph_is_refused_either_way(policy: str) -> None:
    plain, done = _pair(Stack, policy)
    x = torch.randn(3, 16)
    plain.eval()  # no dropout, so nothing differs but the graph
    done.eval()
    errors = []
    for model in (plain, done):
        loss = model(x).square().sum()
        loss.backward()
        with pytest.raises(RuntimeError) as info:
            loss.backward()
        errors.append(type(info.value))
    assert errors == [RuntimeError, RuntimeError]


def test_double_backward_gives_the_same_second_derivatives() -> None:
    # Non-reentrant checkpoint supports torch.autograd.grad(create_graph=True).
    plain, done = _pair(Stack, "full")
    plain.eval()
    done.eval()
    results = []
    for model in (plain, done):
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        (gx,) = torch.autograd.grad(model(x).tanh().sum(), x, create_graph=True)
        gx.square().sum().backward()
        results.append((gx.detach(), _grads(model)))
    assert torch.equal(results[0][0], results[1][0])
    _assert_same(results[0][1], results[1][1])


def test_selective_refuses_a_second_backward_through_a_block_as_torch_does() -> None:
    # torch's selective checkpoint replays the ops it kept once: a second backward
    # (retain_graph=True, or a double backward) through a selective block is refused
    # by torch itself, documented in docs/memory.md.
    _, done = _pair(Stack, "selective")
    done.eval()
    loss = done(torch.randn(3, 16)).square().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward once"):
        loss.backward()
    x = torch.randn(3, 16, requires_grad=True)
    (gx,) = torch.autograd.grad(done(x).tanh().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="backward once"):
        gx.square().sum().backward()


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of activations the forward saves for the backward (parameters not counted)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if not isinstance(t, nn.Parameter):
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().sum()
    loss.backward()
    return total


def test_fewer_activations_are_kept_and_selective_keeps_more_than_full() -> None:
    torch.manual_seed(0)
    model = Stack(depth=4, width=32)
    x = torch.randn(16, 32, requires_grad=True)
    plain = _saved_bytes(model, x)
    full = _saved_bytes(recompute(copy.deepcopy(model), "full"), x)
    half = _saved_bytes(recompute(copy.deepcopy(model), "full", every=2), x)
    # A full block keeps only its input, 16 x 32 floats; square() keeps the output.
    assert full == (4 + 1) * 16 * 32 * 4
    assert full < half < plain
    assert full * 10 < plain


# --------------------------------------------------------------------------- hooks


@pytest.mark.parametrize("policy", POLICIES)
def test_hooks_on_the_block_fire_once_inside_it_again_in_the_recompute(policy: str) -> None:
    plain, done = _pair(Stack, policy)
    x = torch.randn(2, 16)
    calls: dict[str, list[str]] = {}
    for label, model in (("plain", plain), ("done", done)):
        log = calls[label] = []
        block = model.layers[1]
        block.register_forward_pre_hook(lambda m, a, log=log: log.append("pre"))
        block.register_forward_hook(lambda m, a, o, log=log: log.append("post"))
        block.register_full_backward_hook(lambda m, gi, go, log=log: log.append("backward"))
        block.up.register_forward_hook(lambda m, a, o, log=log: log.append("inner"))
        _run(model, x.detach().clone().requires_grad_())
    # The block's own hooks run around its forward, once; a submodule's forward (and
    # so its hooks) runs again in the recompute, as under torch.utils.checkpoint.
    assert calls["plain"] == ["pre", "inner", "post", "backward"]
    assert calls["done"] == ["pre", "inner", "post", "inner", "backward"]
    _assert_same(_grads(plain), _grads(done))


def test_a_forward_hook_that_changes_the_output_is_kept() -> None:
    plain, done = _pair(Stack, "full")
    for model in (plain, done):
        model.layers[0].register_forward_hook(lambda m, a, o: o * 2)
    x = torch.randn(2, 16)
    out1, _ = _run(plain, x)
    out2, _ = _run(done, x)
    assert torch.equal(out1, out2)
    _assert_same(_grads(plain), _grads(done))


# --------------------------------------------------------------------------- state dict


@pytest.mark.parametrize("policy", POLICIES)
def test_state_dict_keys_and_loads_both_ways(policy: str) -> None:
    plain, done = _pair(NormedNet, policy)
    _run(done, torch.randn(8, 6))
    assert list(done.state_dict()) == list(plain.state_dict())
    fresh = NormedNet()
    assert fresh.load_state_dict(done.state_dict()) == nn.modules.module._IncompatibleKeys([], [])
    back = recompute(NormedNet(), policy)
    back.load_state_dict(fresh.state_dict())
    for key, value in done.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    assert recomputed_blocks(back) == ["layers.0", "layers.1"]


# --------------------------------------------------------------------------- selective


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _backward_ops(model: nn.Module) -> list[str]:
    model.eval()
    loss = model(torch.randn(4, 16)).square().sum()
    with _Count() as count:
        loss.backward()
    return count.ops


def test_selective_keeps_matmul_outputs_and_recomputes_the_cheap_ops() -> None:
    # torchtitan's op-level policy: mm outputs saved, element-wise ops recomputed.
    torch.manual_seed(0)
    model = Stack(depth=2)
    plain = _backward_ops(model)
    full = _backward_ops(recompute(copy.deepcopy(model), "full"))
    selective = _backward_ops(recompute(copy.deepcopy(model), "selective"))
    assert plain.count("addmm") == 0
    assert plain.count("gelu") == 0
    # Full runs each block again, up to the last tensor the backward needs (torch's
    # early stop: the up projection and gelu, not the down projection).
    assert full.count("addmm") == 2
    assert full.count("gelu") == 2
    assert selective.count("addmm") == 0  # kept from the forward
    assert selective.count("gelu") == 2  # recomputed
    for name in ("mm", "gelu_backward"):  # the backward itself is the same
        assert plain.count(name) == full.count(name) == selective.count(name)


# --------------------------------------------------------------------------- FSDP2


@pytest.fixture(scope="module")
def fsdp_results() -> list[dict[str, Any]]:
    return cp.launch(fsdp_steps, [None, "full", "selective"], nprocs=2, timeout=180)


@pytest.mark.distributed
@pytest.mark.parametrize("policy", POLICIES)
def test_fsdp2_with_recompute_trains_like_without_bit_for_bit(
    fsdp_results: list[dict[str, Any]], policy: str
) -> None:
    # test_checkpoint.py's composable checks: random, multi-output and multi-input
    # blocks, each its own FSDP2 unit, two ranks with their own batches and streams.
    for rank, result in enumerate(fsdp_results):
        want, got = result["None"], result[policy]
        assert got["recomputed"] == [f"layers.{i}" for i in range(5)], rank
        assert want["recomputed"] == [], rank
        assert got["keys"] == want["keys"] == list(chain().state_dict()), rank
        for a, b in zip(want["losses"], got["losses"], strict=True):
            assert torch.equal(a, b), rank
    want, got = fsdp_results[0]["None"]["state"], fsdp_results[0][policy]["state"]
    assert want.keys() == got.keys()
    assert want
    for key in want:
        assert torch.equal(want[key], got[key]), key
